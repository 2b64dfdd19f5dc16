"""`HFWeightSource`: a `WeightSource` over an in-process Hugging Face causal LM.

It implements both levels of mlrl.weight_sync.source in one process: one sender, its parameters
named exactly as in the HF checkpoint (tied weights sent once). A peft LoRA model also answers
PushRequest.content="adapters" (its adapter tensors, peft-named as in adapter_model.safetensors),
and its canary logprobs are those of the adapted model.

Not part of the `mlrl` package (no run uses it: a run's source is the Megatron trainer): it is the
sender of tools/bench_weight_sync.py and of the weight-sync tests, which load it with
`helpers.tools.load_tool("hf_weight_source")`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from mlrl.weight_sync.sender import bucketize, push_from_rank
from mlrl.weight_sync.source import PushRequest, SendReport
from mlrl.weight_sync.wire import NamedTensors


class HFWeightSource:
    """A `WeightSource` over an in-process HF causal LM (single sender)."""

    num_senders = 1

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "HFWeightSource":
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        return cls(model.eval())

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named parameters; a tied LM head shares the embedding's storage and is sent once (as the embedding)."""
        seen: set[int] = set()
        for name, p in self.model.named_parameters():
            ptr = p.data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            yield name, p.detach()

    def iter_buckets(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        return bucketize(self.named_tensors(), bucket_bytes)

    def adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A peft model's LoRA adapters, named as peft saves them (get_peft_model_state_dict)."""
        from peft import get_peft_model_state_dict

        yield from get_peft_model_state_dict(self.model).items()

    def push(self, request: PushRequest) -> list[SendReport]:
        req = PushRequest.from_json(request)
        if req.content == "adapters":
            def buckets(bucket_bytes: int) -> Iterator[NamedTensors]:
                return bucketize(self.adapter_tensors(), bucket_bytes)
        else:
            buckets = self.iter_buckets
        rep = push_from_rank(req, buckets, 0)
        return [rep] if rep is not None else []

    @torch.no_grad()
    def canary_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        device = next(self.model.parameters()).device
        ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=device)
        logits = self.model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        p = len(prompt_ids)
        return [float(lp[p - 1 + i, t]) for i, t in enumerate(completion_ids)]

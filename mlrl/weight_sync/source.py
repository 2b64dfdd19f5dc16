"""The trainer as the weight sync sees it (`WeightSource`), and an in-process HF implementation.

Two levels, because the trainer is usually other processes:
- on each trainer rank, a bucket iterator `buckets(bucket_bytes) -> Iterable[list[(hf_name,
  tensor)]]` (the Megatron policy's `iter_hf_buckets`: a collective, senders yield, others
  yield nothing) and the rank-side entry point `mlrl.weight_sync.sender.push_from_rank`;
- in the driver, a `WeightSource`: `push(request)` makes every trainer rank run
  `push_from_rank(request, buckets, sender_index)` and returns the senders' reports; and
  `canary_logprobs` computes the trainer's logprobs of a fixed token sequence, to compare with
  the engines' after every sync.

`HFWeightSource` implements both levels in one process from a Hugging Face causal LM (tests,
the benchmark, and any trainer that holds an HF-layout model): one sender, its parameters
named exactly as in the HF checkpoint (tied weights sent once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Protocol, runtime_checkable

import torch

from mlrl.weight_sync.sender import PushRequest, SendReport, bucketize, push_from_rank
from mlrl.weight_sync.wire import NamedTensors


@runtime_checkable
class WeightSource(Protocol):
    """Driver-side handle on the trainer's weights."""

    @property
    def num_senders(self) -> int:
        """K: ranks that send (one per pipeline stage); sender indices are 0..K-1."""
        ...

    def push(self, request: PushRequest) -> list[SendReport]:
        """Blocking: run `push_from_rank(request, ...)` on every trainer rank; the K senders' reports, by sender index.
        Called from a worker thread while the driver drives the engines; must not hold the event loop."""
        ...

    def canary_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """logprob (temperature 1) of each completion token given prompt + preceding completion tokens."""
        ...


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

    def push(self, request: PushRequest) -> list[SendReport]:
        rep = push_from_rank(request, self.iter_buckets, 0)
        return [rep] if rep is not None else []

    @torch.no_grad()
    def canary_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        device = next(self.model.parameters()).device
        ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=device)
        logits = self.model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        p = len(prompt_ids)
        return [float(lp[p - 1 + i, t]) for i, t in enumerate(completion_ids)]

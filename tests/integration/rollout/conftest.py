"""A tiny Llama that the vLLM CPU build can serve, and HF reference logprobs.

vLLM's CPU attention backend supports head sizes 32, 64, 80, ... only
(vllm/v1/attention/backends/cpu_attn.py: get_supported_head_sizes); `builtin:tiny-llama` uses
head_dim 16, which starts but fails at the first request ("Unsupported CPU attention
configuration: head_dim=16"). Until the builtin changes, the fixture derives a variant with
head_dim 32 (same vocabulary, tokenizer, chat template and layer count; seeded random init).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@pytest.fixture(scope="session")
def vllm_tiny_llama(tmp_path_factory) -> Path:
    import transformers

    from mlrl.modelzoo import resolve_model_dir

    src = resolve_model_dir("builtin:tiny-llama")
    out = tmp_path_factory.mktemp("tiny-llama-vllm")
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy2(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        cfg["head_dim"] = 32
        config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "transformers_version"})
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


@torch.no_grad()
def hf_token_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0,
                      suppressed: tuple[int, ...] = ()) -> list[float]:
    """log p(output[i] | prompt + output[:i]) under `model`, logits divided by `temperature`;
    `suppressed` token ids get -inf first (what vLLM's min_tokens processor does to EOS, and what
    its processed logprobs therefore reflect)."""
    ids = torch.tensor([list(prompt) + list(output)])
    logits = model(input_ids=ids).logits[0].float() / temperature
    if suppressed:
        logits[:, list(suppressed)] = float("-inf")
    lp = torch.log_softmax(logits, -1)
    p = len(prompt)
    return [float(lp[p - 1 + i, t]) for i, t in enumerate(output)]

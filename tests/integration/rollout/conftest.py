"""`vllm_tiny_llama`: a private copy of builtin:tiny-llama for the vLLM CPU tests.

vLLM's CPU attention backend supports head sizes 32, 64, 80, ... only
(vllm/v1/attention/backends/cpu_attn.py: get_supported_head_sizes); a model with head_dim 16
starts but fails at its first request ("Unsupported CPU attention configuration"). The fixture
checks that up front so such a failure names its cause.
"""

import json
import shutil
from pathlib import Path

import pytest

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@pytest.fixture(scope="session")
def vllm_tiny_llama(tmp_path_factory) -> Path:
    from mlrl.modelzoo import resolve_model_dir

    src = resolve_model_dir("builtin:tiny-llama")
    cfg = json.loads((src / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert head_dim in VLLM_CPU_HEAD_SIZES, (
        f"{src}: head_dim {head_dim} is not served by vLLM's CPU attention {VLLM_CPU_HEAD_SIZES}"
    )
    out = tmp_path_factory.mktemp("tiny-llama-vllm")
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy2(f, out / f.name)
    return out

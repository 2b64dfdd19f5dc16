"""HF <-> Megatron-Core weight bridge (pure torch: imports no megatron, no vllm).

- `spec_for(hf_config) -> (ArchSpec, ModelArch)`: the spec registered for the HF `model_type`
  (llama, mistral, qwen2, qwen3, qwen3_moe) and the parsed architecture;
- `ArchSpec.params / to_megatron / to_hf / transformer_config / gpt_model_kwargs`: names,
  shapes, conversions and the Megatron config fields;
- `sharding`: TP / EP tensor splits; `layout`: which layers and experts a rank holds, `check_layout`;
- `HFCheckpoint`: validate a safetensors folder against the config, read selected tensors.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mlrl.bridge.arch import BridgeError, ModelArch
from mlrl.bridge.layout import check_layout, rank_experts, stage_layers
from mlrl.bridge.naming import global_name
from mlrl.bridge.specs import ArchSpec, ParamSpec, get_spec, register, spec_for, supported_model_types

if TYPE_CHECKING:
    from mlrl.bridge.hf_checkpoint import HFCheckpoint
    from mlrl.bridge.sharding import padded_vocab_size, shard, unshard

# The tensor modules import torch (~1.2 s): loaded on first use, so that config validation
# (mlrl.bridge.select, the specs) runs before the launcher has imported torch and the engines start sooner.
_LAZY = {"HFCheckpoint": "hf_checkpoint", **{name: "sharding" for name in ("padded_vocab_size", "shard", "unshard")}}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"mlrl.bridge.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'mlrl.bridge' has no attribute {name!r}")

__all__ = [
    "ArchSpec", "BridgeError", "HFCheckpoint", "ModelArch", "ParamSpec", "check_layout", "get_spec",
    "global_name", "padded_vocab_size", "rank_experts", "register", "shard", "spec_for", "stage_layers",
    "supported_model_types", "unshard",
]

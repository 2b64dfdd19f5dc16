"""HF <-> Megatron-Core weight bridge (pure torch: imports no megatron, no vllm).

- `spec_for(hf_config) -> (ArchSpec, ModelArch)`: the spec registered for the HF `model_type`
  (llama, mistral, qwen2, qwen3, qwen3_moe) and the parsed architecture;
- `ArchSpec.params / to_megatron / to_hf / transformer_config / gpt_model_kwargs`: names,
  shapes, conversions and the Megatron config fields;
- `sharding`: TP / PP / EP layout rules and `check_layout`;
- `HFCheckpoint`: validate a safetensors folder against the config, read selected tensors.
"""

from mlrl.bridge.arch import BridgeError, ModelArch
from mlrl.bridge.hf_checkpoint import HFCheckpoint
from mlrl.bridge.naming import global_name
from mlrl.bridge.sharding import check_layout, padded_vocab_size, rank_experts, shard, stage_layers, unshard
from mlrl.bridge.specs import ArchSpec, ParamSpec, get_spec, register, spec_for, supported_model_types

__all__ = [
    "ArchSpec", "BridgeError", "HFCheckpoint", "ModelArch", "ParamSpec", "check_layout", "get_spec",
    "global_name", "padded_vocab_size", "rank_experts", "register", "shard", "spec_for", "stage_layers",
    "supported_model_types", "unshard",
]

"""`model.bridge`: which HF <-> Megatron bridge a model goes through.

- `builtin`: mlrl's own bridge (this package): the llama / mistral / qwen2 / qwen3 / qwen3_moe
  family, RoPE default / linear / llama3 / yarn. Pure torch, runs everywhere, bit-exact, and
  the only one that knows mlrl's LoRA and critic layouts.
- `megatron-bridge`: NVIDIA's megatron-bridge (`AutoBridge`), for every architecture it supports:
  model build, HF weight import, HF export and the weight stream for sync
  (mlrl.trainer.rank.mbridge). A GPU-environment extra (`pip install '.[bridge]'` with
  pyproject.vllm.toml): it needs Python >= 3.12 and Transformer Engine, so it cannot be installed on
  the CPU machines.
- `auto` (default): builtin when the built-in bridge supports the model, else megatron-bridge
  when it is installed, else the built-in bridge's error plus what would cover the model.

Resolution reads package metadata only (nothing is imported), so it runs in config validation.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from mlrl.bridge.arch import ROPE_TYPES, BridgeError
from mlrl.bridge.specs import spec_for, supported_model_types

BRIDGES = ("auto", "builtin", "megatron-bridge")
MEGATRON_BRIDGE_DIST = "megatron-bridge"


def megatron_bridge_version() -> str | None:
    """The installed megatron-bridge version (None: not installed)."""
    try:
        return metadata.version(MEGATRON_BRIDGE_DIST)
    except metadata.PackageNotFoundError:
        return None


def _missing(field: str) -> BridgeError:
    return BridgeError(
        f"{field}: megatron-bridge is not installed (package {MEGATRON_BRIDGE_DIST!r}, module megatron.bridge); it is "
        "the GPU environment's `bridge` extra (pip install '.[bridge]' with pyproject.vllm.toml: Python >= 3.12, "
        "Transformer Engine) and cannot be installed on a CPU machine; use model.bridge=builtin or auto")


def resolve_bridge(choice: str, hf: dict[str, Any], *, field: str = "model.bridge",
                   assume_installed: bool = False) -> str:
    """'builtin' or 'megatron-bridge' for this HF config, or a BridgeError naming the field, the
    model and what would support it. `assume_installed`: plan for a cluster whose environment has
    megatron-bridge (--dry-run on a CPU machine)."""
    if choice not in BRIDGES:
        raise BridgeError(f"{field}={choice!r}: expected one of {', '.join(BRIDGES)}")
    installed = assume_installed or megatron_bridge_version() is not None
    if choice == "megatron-bridge":
        if not installed:
            raise _missing(f"{field}=megatron-bridge")
        return "megatron-bridge"
    try:
        spec_for(hf)
        return "builtin"
    except BridgeError as e:
        if choice == "auto" and installed:
            return "megatron-bridge"
        hint = ("" if choice == "builtin" else
                "; megatron-bridge (model.bridge=megatron-bridge, the GPU environment's `bridge` extra) covers "
                "further architectures but is not installed here")
        raise BridgeError(f"{field}={choice}: {e}{hint}") from None


def builtin_support() -> dict[str, list[str]]:
    """What the built-in bridge supports (printed by tools/convert_checkpoint.py --list)."""
    return {"model_types": supported_model_types(), "rope_types": list(ROPE_TYPES)}

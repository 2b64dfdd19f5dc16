"""What trainer.deterministic and model.dtype mean for a rank's environment (no torch, no
megatron: the driver puts these variables into every rank it spawns, and each rank applies them
again with its torch flags in mlrl.trainer.rank.numerics, whose doc explains each one)."""

from __future__ import annotations

from typing import Union

from mlrl.config.schema import ModelConfig, TrainerConfig

DETERMINISTIC_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
FP32_ENV = {"NVIDIA_TF32_OVERRIDE": "0"}


def deterministic(setting: Union[bool, str], *, gpu: bool) -> bool:
    """trainer.deterministic resolved for the device: `auto` = exact on CPU, fast on GPU."""
    if setting == "auto":
        return not gpu
    return bool(setting)


def rank_env(model: ModelConfig, trainer: TrainerConfig, *, gpu: bool) -> dict[str, str]:
    """Environment variables a rank needs before CUDA libraries start (empty on CPU)."""
    if not gpu:
        return {}
    env: dict[str, str] = {}
    if deterministic(trainer.deterministic, gpu=True):
        env.update(DETERMINISTIC_ENV)
    if model.dtype == "float32":
        env.update(FP32_ENV)
    return env

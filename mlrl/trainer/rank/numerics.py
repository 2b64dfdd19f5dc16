"""The numerics a trainer rank runs with: determinism and TF32, from the config and the device.

`trainer.deterministic`:
- `auto` (default): deterministic on CPU (the CPU path is deterministic anyway: gloo and fixed-
  order reductions), off on GPU, where deterministic kernels cost speed and memory (measured on
  an H100, Llama-3.2-1B shape: ~10% fewer tokens/s at 1k tokens, and TE's deterministic fused-
  attention backward asked for 128 GiB at 2k tokens).
- `true` on GPU: megatron-core's `deterministic_mode`, which refuses TE's DotProductAttention
  unless `NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`; that variable also makes TE pick deterministic
  attention and grouped-GEMM kernels. cuBLAS needs `CUBLAS_WORKSPACE_CONFIG=:4096:8` for
  reproducible GEMMs, cuDNN its deterministic algorithms, and torch its deterministic ops
  (`use_deterministic_algorithms(warn_only=True)`: an op without a deterministic version warns).
- `false` on CPU is refused by validation (it could not change anything there).

`model.dtype=float32` on GPU means fp32 arithmetic: TF32 off for torch's matmuls and cuDNN, and
`NVIDIA_TF32_OVERRIDE=0` for the libraries torch's flags do not reach (Transformer Engine's
cuBLASLt GEMMs run fp32 inputs in TF32 otherwise: issue 30's H100 run measured a logprob
parity error of 2.9e-4 against the tests' 1e-4, passing with NVIDIA_TF32_OVERRIDE=0).
cuBLAS reads that variable when it initialises, so the driver also puts
`rank_env` into every rank's environment at spawn; `configure` sets it again for ranks started
by other means (tools, tests) before their first GEMM.

Both are applied by `configure`, called first thing in every rank's policy construction, before
any Transformer Engine module is built.
"""

from __future__ import annotations

import os

import torch

from mlrl.config.schema import ModelConfig, TrainerConfig
from mlrl.config.validate import TE_INSTALL_HINT, transformer_engine_installed
from mlrl.trainer.numerics_env import DETERMINISTIC_ENV, FP32_ENV, deterministic, rank_env

__all__ = ["DETERMINISTIC_ENV", "FP32_ENV", "configure", "deterministic", "rank_env"]


def configure(model: ModelConfig, trainer: TrainerConfig, *, gpu: bool | None = None) -> dict[str, object]:
    """Apply the rank's numerics (see the module doc); returns what was set (for logs and tests).
    On GPU without Transformer Engine this raises before any model is built."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    applied: dict[str, object] = {"deterministic": deterministic(trainer.deterministic, gpu=gpu), "gpu": gpu}
    if not gpu:
        return applied
    if not transformer_engine_installed():
        raise RuntimeError(f"this trainer rank has CUDA but Transformer Engine is not installed: {TE_INSTALL_HINT}")
    env = rank_env(model, trainer, gpu=True)
    os.environ.update(env)
    applied["env"] = env
    if model.dtype == "float32":  # (bf16 / fp16 runs keep torch's defaults)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        applied["tf32"] = False
    if applied["deterministic"]:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    return applied

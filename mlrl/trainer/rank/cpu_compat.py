"""Lets megatron-core run on machines without CUDA (gloo, CPU tensors), and only there.

megatron-core assumes a CUDA device in a handful of places. `apply()` patches exactly those
places, each entry below naming the megatron-core code it covers; on a machine where
`torch.cuda.is_available()` is True it does nothing, so the GPU path always runs unmodified
megatron-core. Patches are idempotent and process-wide (a trainer rank is one process).

Mechanisms, from the most to the least global:

1. `torch.cuda` stand-ins (process-wide, only for functions that raise on a CUDA-less torch):
   `current_device()` -> "cpu" (tensor_parallel/layers.py, mappings.py, utils.py
   GlobalMemoryBuffer, rotary_pos_embedding.get_emb, moe/router.py, moe/experts.py,
   p2p_communication.py, distrib_optimizer.py ...); `Stream`, `Event`, `current_stream`,
   `default_stream`, `stream(...)`, `synchronize()` -> no-op objects
   (distributed/param_and_grad_buffer.py, moe/token_dispatcher.py, p2p_communication.py).
   On a CUDA-less torch these functions can only raise, so no working code changes meaning.
2. A per-module `torch` proxy that maps `device="cuda"` in tensor factories to the CPU, for the
   modules that allocate with the literal "cuda": pipeline_parallel/schedules.py
   (total_num_tokens), optimizer/clip_grads.py (norm / overflow buffers), optimizer/optimizer.py
   (found_inf, scale buffers), transformer/utils.py (get_default_causal_mask), utils.py
   (local_multi_tensor_l2_norm, the grad-norm fallback without apex / TE),
   transformer/moe/moe_utils.py (aux-loss trackers), distributed/param_and_grad_buffer.py.
3. RNG: tensor_parallel/random.py keeps CUDA RNG states (model_parallel_cuda_manual_seed,
   CudaRNGStatesTracker.add/fork, _get/_set_cuda_rng_state). DotProductAttention.forward always
   forks the tracker, so it must exist and be seeded: the tracker keeps CPU generator states
   instead, and the state getters/setters use the CPU generator (accepting any keywords, e.g.
   `graph_safe=` that 0.16.1 passes).
4. Tensor methods, only inside `cuda_tensor_methods()` (scoped, restored on exit):
   `Tensor.type()` reports "torch.cuda.FloatTensor" etc. for CPU tensors, for the dtype checks in
   optimizer/optimizer.py, optimizer/distrib_optimizer.py and optimizer/clip_grads.py
   (wrap optimizer construction and `optimizer.step()`); `Tensor.cuda()` returns the tensor
   itself, for language_module.setup_embeddings_and_output_layer (tied embeddings with PP > 1:
   `weight.data.cuda()`) (wrap model construction).
5. transformer/moe/token_dispatcher.py: `maybe_move_tensor_to_cpu(..., as_numpy=True)` leaves
   CPU tensors as tensors, and gloo's all_to_all_single rejects tensor split sizes: on CPU the
   replacement returns numpy arrays (what the CUDA path returns).
6. transformer/moe/moe_utils.py in 0.16.1 imports `te_general_gemm` only inside the TE try-block,
   so without TE the router's `RouterGatingLinearFunction` raises NameError: define it as None.
7. megatron/core/jit.py: `jit_fuser` is `torch.compile`, bound when megatron.core is first
   imported, and some 30 functions (fusions/*, activations.py, transformer/utils.py, ...) are
   decorated with it while the package imports: each `torch.compile(fn)` imports torch._dynamo
   and inductor, ~2.6 CPU s of every rank's start on 2 cores (measured: `import megatron.core`
   6.4 -> 3.8 CPU s). On the CPU the fused paths those functions serve are off
   (`bias_activation_fusion`, `bias_dropout_fusion`, `apply_rope_fusion` follow the GPU, see
   model.py), and where one would run it runs eagerly, as megatron's own `disable_jit_fuser()`
   makes it. That function cannot be called before the package's `__init__` decorates them, so
   while `apply()` first imports megatron.core, `torch.compile` returns the function itself;
   then `disable_jit_fuser()` covers modules imported later, and `torch.compile` is restored.
8. inference/contexts/dynamic_context.py, inference/engines/dynamic_engine.py and timers.py
   import wandb, when installed, for megatron's own inference and timer logging, which a trainer
   rank does not use (mlrl logs to wandb from the launcher): ~0.9 CPU s of the same import. While
   megatron.core first imports (with 7), `import wandb` fails there as if it were not installed,
   which those modules handle (`wandb = None`); afterwards wandb imports normally.
   `MLRL_CPU_EAGER_FUSER=0` in a rank's environment keeps megatron's own import (7 and 8 off), for
   tools/bench_rank_start.py's side-by-side measurement.

Context parallelism needs TEDotProductAttention and is GPU-only by design (not patched).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import types
from typing import Any, Iterator

import torch

_APPLIED = False
EAGER_FUSER_ENV = "MLRL_CPU_EAGER_FUSER"  # "0": mechanisms 7 and 8 off (tools/bench_rank_start.py)

# Modules that allocate with device="cuda" literals (mechanism 2), with the place covered.
_DEVICE_LITERAL_MODULES = {
    "megatron.core.pipeline_parallel.schedules": "total_num_tokens = torch.zeros(..., device='cuda')",
    "megatron.core.optimizer.clip_grads": "norm / overflow buffers in get_grad_norm_fp32, clip_grad_by_total_norm_fp32",
    "megatron.core.optimizer.optimizer": "found_inf / _dummy_overflow_buf / _scale_one buffers",
    "megatron.core.transformer.utils": "get_default_causal_mask / sliding-window masks",
    "megatron.core.transformer.moe.moe_utils": "MoE layer-wise logging trackers",
    "megatron.core.distributed.param_and_grad_buffer": "warm-up tensor of the grad buffers",
    "megatron.core.utils": "local_multi_tensor_l2_norm (grad norm without apex / TE)",
}

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def needed() -> bool:
    """True when CUDA is absent, i.e. when the compat layer applies."""
    return not torch.cuda.is_available()


class _NoStream:
    """Stands in for torch.cuda.Stream / Event on the CPU: every operation is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> "_NoStream":
        return _NoStream()

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, *args: Any) -> float:
        return 0.0


_DEFAULT_STREAM = _NoStream()


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.Stream = _NoStream
    cuda.Event = _NoStream
    cuda.current_stream = lambda *a, **k: _DEFAULT_STREAM
    cuda.default_stream = lambda *a, **k: _DEFAULT_STREAM
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None


def _cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _device_to_cpu(fn):
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class _TorchOnCpu(types.ModuleType):
    """The `torch` a patched megatron module sees: tensor factories map device 'cuda' to 'cpu'."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "as_tensor", "rand", "randn",
                  "randint", "zeros_like", "ones_like", "empty_like", "full_like")

    def __init__(self) -> None:
        super().__init__("torch")
        for name in self._FACTORIES:
            setattr(self, name, _device_to_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _patch_device_literals() -> None:
    proxy = _TorchOnCpu()
    for name in _DEVICE_LITERAL_MODULES:
        mod = importlib.import_module(name)
        if getattr(mod, "torch", None) is torch:
            mod.torch = proxy  # pyright: ignore[reportAttributeAccessIssue]  # a module's global, replaced


class _CpuRNGStatesTracker:
    """Mixin body for megatron's CudaRNGStatesTracker that keeps CPU generator states."""

    seeds_: set[int]  # CudaRNGStatesTracker's
    states_: dict[str, torch.Tensor]
    _is_initialized: bool

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    tracker_cls = type("CpuRNGStatesTracker", (mrandom.CudaRNGStatesTracker,), {"add": _CpuRNGStatesTracker.add})

    def get_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(new_state)

    def initialize_rng_tracker(*args: Any, force_reset: bool = False, **kwargs: Any) -> None:
        if mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED and not force_reset:
            return
        mrandom._CUDA_RNG_STATE_TRACKER = tracker_cls()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.initialize_rng_tracker = initialize_rng_tracker


def _patch_moe() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                return tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def apply() -> bool:
    """Apply every patch once when CUDA is absent; returns whether the compat layer is active."""
    global _APPLIED
    if not needed():
        return False
    if _APPLIED:
        return True
    _patch_torch_cuda()
    eager = os.environ.get(EAGER_FUSER_ENV, "1") != "0"
    with _eager_jit_fuser() if eager else contextlib.nullcontext():
        _patch_device_literals()  # the first import of megatron.core
    _patch_rng()
    _patch_moe()
    _APPLIED = True
    return True


@contextlib.contextmanager
def _eager_jit_fuser() -> Iterator[None]:
    """Mechanisms 7 and 8: no `torch.compile` and no wandb while megatron.core imports, megatron's
    no-op jit_fuser after."""
    compile_ = torch.compile
    hide_wandb = "wandb" not in sys.modules

    def eager(model: Any = None, **kwargs: Any) -> Any:  # torch.compile(fn) and torch.compile(**options)(fn)
        return model if model is not None else (lambda fn: fn)

    torch.compile = eager  # pyright: ignore[reportAttributeAccessIssue]  # restored below
    if hide_wandb:
        sys.modules["wandb"] = None  # pyright: ignore[reportArgumentType]  # `import wandb` raises ImportError
    try:
        yield
    finally:
        torch.compile = compile_
        if hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]
    from megatron.core import jit

    jit.disable_jit_fuser()


def _cuda_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any):
    if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
        return _CUDA_TYPE_NAMES[self.dtype]
    return _ORIG_TYPE(self, dtype, non_blocking, **kwargs) if dtype is not None else _ORIG_TYPE(self)


def _cuda_identity(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


_ORIG_TYPE = torch.Tensor.type


@contextlib.contextmanager
def cuda_tensor_methods() -> Iterator[None]:
    """Mechanism 4: CPU tensors pass megatron's `param.type() == 'torch.cuda.FloatTensor'`
    checks and `.cuda()` is the identity, for the duration of the block (no-op with CUDA)."""
    if not needed():
        yield
        return
    orig_type, orig_cuda = torch.Tensor.type, torch.Tensor.cuda
    torch.Tensor.type = _cuda_type  # pyright: ignore[reportAttributeAccessIssue]  # also returns type names
    torch.Tensor.cuda = _cuda_identity
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = orig_type, orig_cuda


__all__ = ["apply", "needed", "cuda_tensor_methods"]

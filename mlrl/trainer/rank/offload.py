"""Trainer offload / reload for colocated placement (cluster.placement=colocated).

While the engines generate, the trainer gives their device memory back: the optimizer state and
the gradient buffers always, the parameters too with cluster.colocate.offload_params. Offload
works per storage, the way FSDP frees its flat parameters: the bytes of each distinct storage
are copied into a host buffer (pinned, non-blocking on GPU) and the storage is resized to 0;
reload resizes it back and copies the bytes in. Every tensor that views the storage (Megatron's
contiguous param / grad buffers and the parameters that are views into them, the distributed
optimizer's shards, `main_grad`) is therefore valid again after reload, with the same bytes.

What moves, per model on this rank (policy, frozen KL reference, critic):
    params     every parameter's storage (LoRA: the frozen base and the adapters)
    grads      the gradient buffers (`param.main_grad`'s storages): released, not copied; reload
               hands them back zeroed (every train step zeroes them before its backward pass anyway)
    optimizer  the optimizer's state tensors and its main parameters (fp32 master copies, shards),
               except storages that are model parameters or gradients (an fp32 optimizer steps the
               parameters themselves)

On CPU the "device" is host memory: the move is host to host, still frees the original storages
and must leave the model exact (tests/integration/trainer/test_offload.py checks bit-identity).
On GPU the freed blocks go back to the driver (`torch.cuda.empty_cache`) so a vLLM engine in
another process can use them. The report's `measured` is what the device's allocator saw
(torch.cuda.memory_allocated before / after the storages are released or re-allocated), not the
offloader's own sum of storage sizes: the check that the bytes it counts really left the device
(colocate/offload_measured_bytes, asserted by tests/gpu/test_colocate_gpu.py). 0 on CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

KINDS = ("params", "grads", "optimizer")


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # uint8 copy of the bytes; None = discarded (zeroed on reload)


@dataclass
class OffloadReport:
    bytes: dict[str, int] = field(default_factory=dict)   # kind -> bytes released from the device
    copied: int = 0                                        # bytes copied device -> host (or back)
    measured: int = 0                                      # CUDA allocator's allocated bytes freed (offload) /
                                                           # taken (reload), measured; 0 on CPU
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"bytes": dict(self.bytes), "copied": self.copied, "measured": self.measured, "seconds": self.seconds}


def _cuda_devices(storages: Iterable[torch.UntypedStorage]) -> set[torch.device]:
    return {s.device for s in storages if s.device.type == "cuda"}


def _allocated(devices: set[torch.device]) -> int:
    """Bytes the CUDA caching allocator holds for live tensors on `devices` (0 for none: CPU)."""
    return sum(torch.cuda.memory_allocated(d) for d in devices)


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _storages(tensors: Iterable[torch.Tensor | None]) -> Iterator[torch.UntypedStorage]:
    seen: set[int] = set()
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        yield s


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """Megatron's optimizer (ChainedOptimizer or one MegatronOptimizer) -> the torch optimizers inside."""
    if optimizer is None:
        return []
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [getattr(o, "optimizer", o) for o in chained]


def model_tensors(model: Any) -> dict[str, list[torch.Tensor]]:
    """The tensors of each kind of one built model (a MegatronPolicy or MegatronCritic)."""
    params = [p for m in model.model for p in m.parameters()]
    grads = [getattr(p, "main_grad", None) for p in params]
    state: list[torch.Tensor] = []
    for opt in _inner_optimizers(getattr(model, "optimizer", None)):
        for s in opt.state.values():
            state += [v for v in s.values() if isinstance(v, torch.Tensor)]
        state += [p for g in opt.param_groups for p in g["params"]]
    return {"params": params, "grads": [g for g in grads if g is not None], "optimizer": state}


class Offloader:
    """Offloads the listed kinds of a set of models and reloads them (one instance per rank)."""

    def __init__(self, models: Iterable[Any]) -> None:
        self.models = [m for m in models if m is not None]
        self.held: dict[str, list[_Held]] = {}
        self._pin = torch.cuda.is_available()

    def offloaded(self) -> list[str]:
        return sorted(self.held)

    def _collect(self, kind: str) -> list[torch.UntypedStorage]:
        per_kind = [model_tensors(m) for m in self.models]
        taken: set[int] = set()
        if kind == "optimizer":  # never the parameters / gradients themselves (an fp32 optimizer steps those)
            taken = {s.data_ptr() for k in ("params", "grads") for mt in per_kind for s in _storages(mt[k])}
        return [s for s in _storages(t for mt in per_kind for t in mt[kind]) if s.data_ptr() not in taken]

    def offload(self, kinds: Iterable[str]) -> OffloadReport:
        t0 = time.perf_counter()
        rep = OffloadReport()
        pending: list[tuple[torch.UntypedStorage, torch.Tensor | None]] = []
        for kind in kinds:
            if kind not in KINDS:
                raise ValueError(f"offload: unknown kind {kind!r}, expected one of {KINDS}")
            if kind in self.held:
                continue
            held = []
            for s in self._collect(kind):
                if not s.resizable():
                    raise RuntimeError(
                        f"offload {kind}: a {s.nbytes()}-byte storage cannot be released because it is not resizable "
                        "(torch marks a storage so once `.numpy()` has viewed it: clone before converting)")
                host = None
                if kind != "grads":
                    host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=self._pin and s.device.type == "cuda")
                    host.copy_(_bytes_view(s), non_blocking=s.device.type == "cuda")
                    rep.copied += s.nbytes()
                held.append(_Held(s, s.nbytes(), host))
                pending.append((s, host))
            self.held[kind] = held
            rep.bytes[kind] = sum(h.nbytes for h in held)
        devices = _cuda_devices(s for s, _ in pending)
        if devices:
            torch.cuda.synchronize()  # the copies must land before the device memory is freed
        allocated = _allocated(devices)
        for s, _ in pending:
            s.resize_(0)
        rep.measured = allocated - _allocated(devices)
        if pending and torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the blocks back to the driver: the engines allocate from it
        rep.seconds = time.perf_counter() - t0
        return rep

    def reload(self, kinds: Iterable[str] | None = None) -> OffloadReport:
        t0 = time.perf_counter()
        rep = OffloadReport()
        names = list(self.held) if kinds is None else [k for k in kinds if k in self.held]
        devices = _cuda_devices(h.storage for k in names for h in self.held[k])
        allocated = _allocated(devices)
        for kind in names:
            for h in self.held.pop(kind):
                h.storage.resize_(h.nbytes)
                view = _bytes_view(h.storage)
                if h.host is None:
                    view.zero_()
                else:
                    view.copy_(h.host, non_blocking=h.storage.device.type == "cuda")
                    rep.copied += h.nbytes
                rep.bytes[kind] = rep.bytes.get(kind, 0) + h.nbytes
        if devices:
            torch.cuda.synchronize()
            rep.measured = _allocated(devices) - allocated
        rep.seconds = time.perf_counter() - t0
        return rep

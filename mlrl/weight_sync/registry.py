"""The weight-sync transports by name: the one place a transport name (`weight_sync.transport`,
`PushRequest.transport`, the "transport" of an update_info) is turned into the transport's parts.

    TRANSPORTS[name] = Transport(driver class, rank-side send, worker-side receive[, release])

Used by `make_weight_sync` (driver), `mlrl.weight_sync.sender.push_from_rank` (trainer ranks) and
`mlrl.weight_sync.receiver.Receiver.receive` (engine workers, via rollout/worker_ext.py). An
unknown name raises `UnknownTransportError` listing the known ones. The parts themselves live in
mlrl.weight_sync.transports.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mlrl.config.schema import LoRAConfig, WeightSyncConfig
from mlrl.interfaces import RolloutPool
from mlrl.weight_sync.source import BucketFn, PushRequest, SendReport, WeightSource
from mlrl.weight_sync.sync import SyncSetup, WeightSync
from mlrl.weight_sync.transports import (
    Apply,
    BroadcastWeightSync,
    CudaIpcWeightSync,
    DiskWeightSync,
    WorkerState,
    receive_broadcast_update,
    receive_disk_update,
    receive_ipc_update,
    release_ipc,
    send_broadcast,
    send_disk,
    send_ipc,
)
from mlrl.weight_sync.wire import Digest

SendFn = Callable[[PushRequest, int, BucketFn, Digest, SendReport], None]
ReceiveFn = Callable[[WorkerState, dict[str, Any], Apply, bool], list[dict[str, Any]]]


@dataclass(frozen=True)
class Transport:
    """One transport's parts (see mlrl.weight_sync.transports)."""

    name: str
    driver: type[WeightSync]   # driver: built as driver(cfg, pool, source, setup)
    send: SendFn               # trainer rank: send(request, sender, buckets, digest, report) fills digest/report
    receive: ReceiveFn         # engine worker: receive(worker, update_info, apply, verify) -> stream summaries
    release: Callable[[], None] | None = None  # trainer rank, phase "release": free what `send` kept alive


TRANSPORTS: dict[str, Transport] = {t.name: t for t in (
    Transport("broadcast", BroadcastWeightSync, send_broadcast, receive_broadcast_update),
    Transport("disk", DiskWeightSync, send_disk, receive_disk_update),
    Transport("cuda_ipc", CudaIpcWeightSync, send_ipc, receive_ipc_update, release=release_ipc),
)}


class UnknownTransportError(ValueError):
    """A transport name that is not in TRANSPORTS."""


def transport(name: Any) -> Transport:
    """The parts of the transport called `name`."""
    try:
        return TRANSPORTS[name]
    except (KeyError, TypeError):
        known = ", ".join(TRANSPORTS)
        raise UnknownTransportError(f"weight_sync.transport: unknown {name!r} (known: {known})") from None


def make_weight_sync(cfg: WeightSyncConfig, pool: RolloutPool, source: WeightSource, *, model_dir: str | Path,
                     engine_tp: int = 1, host: str = "127.0.0.1", run_dir: str | Path | None = None,
                     backend: str | None = None, lora: LoRAConfig | None = None) -> WeightSync:
    """The configured transport's `WeightSync` over `pool`'s live engines (see `SyncSetup` for the
    keyword arguments). It does not touch the pool: to bring an engine restarted after a crash to
    the pool's version, the caller wires `pool.refresher = weight_sync.refresh`.
    `lora` (model.lora) with weight_sync.lora_mode=adapter: the adapters alone, served by vLLM's
    LoRA support (mlrl.weight_sync.lora_adapter); with lora_mode=merged the source already yields
    merged weights and the transport is the configured one."""
    setup = SyncSetup(model_dir=model_dir, engine_tp=engine_tp, host=host, run_dir=run_dir, backend=backend)
    if lora is not None and cfg.lora_mode == "adapter":
        from mlrl.weight_sync.lora_adapter import AdapterWeightSync

        if cfg.transport != "disk":
            raise ValueError(f"weight_sync.lora_mode=adapter needs weight_sync.transport=disk, got {cfg.transport!r}")
        return AdapterWeightSync(cfg, pool, source, setup, lora=lora)
    return transport(cfg.transport).driver(cfg, pool, source, setup)

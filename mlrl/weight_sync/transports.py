"""The three transports behind `WeightSync` (driver side). Each only moves bytes and finishes the
update; pausing, verification, canary and retry live in mlrl.weight_sync.sync.

- `BroadcastWeightSync`: torch.distributed broadcast (gloo on CPU, NCCL on GPU) from the K
  trainer senders to every engine worker (wire protocol: mlrl.weight_sync.wire). The driver
  hosts the rendezvous store; the group is built on the first sync and rebuilt whenever the set
  of live engines changes (an engine restarted) or an attempt failed. Per engine the driver
  issues /init_weight_transfer_engine (new group only), /start_weight_update, /update_weights —
  which blocks while the worker receives — concurrently with `source.push` in a thread, then
  /finish_weight_update with the version.
- `DiskWeightSync`: the senders write safetensors shards under <root>/v<version>; engines read
  them. The newest complete version is kept (older ones deleted), e.g. for inspection.
- `CudaIpcWeightSync` (GPU, colocated trainer and engines): the senders export CUDA IPC handles
  of their tensors, the engines map and load them, then the senders release them.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlrl.weight_sync.sender import PushRequest, SendReport
from mlrl.weight_sync.sync import WeightSync, _Mismatch
from mlrl.weight_sync.wire import GroupSpec, open_store

if TYPE_CHECKING:
    from mlrl.rollout.pool import EngineHandle

_RPC_TIMEOUT_S = 3600.0  # HTTP timeout of calls that block for a whole transfer (the group's own timeout bounds them)


def _check_senders(reports: list[SendReport], k: int) -> list[SendReport]:
    if sorted(r.sender for r in reports) != list(range(k)):
        raise _Mismatch(f"source.push returned reports of senders {sorted(r.sender for r in reports)}, expected 0..{k - 1}")
    return sorted(reports, key=lambda r: r.sender)


async def _finish_all(engines: list["EngineHandle"], version: int) -> list[list[dict[str, Any]]]:
    await asyncio.gather(*(e.client.finish_weight_update(version, timeout=_RPC_TIMEOUT_S) for e in engines))
    return list(await asyncio.gather(*(e.client.collective_rpc("mlrl_weight_report") for e in engines)))


class BroadcastWeightSync(WeightSync):
    transport = "broadcast"

    def __init__(self, cfg, pool, source, *, store_host: str | None = None, backend: str | None = None,
                 timeout_s: float = 600.0) -> None:
        super().__init__(cfg, pool, source)
        host = store_host or pool.cfg.host
        self.store_host = socket.gethostbyname(socket.gethostname()) if host in ("0.0.0.0", "::") else host
        if backend is None:
            import torch

            backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.backend = backend
        self.timeout_s = timeout_s
        self._store = None
        self._spec: GroupSpec | None = None
        self._members: tuple[tuple[int, int], ...] = ()

    def _new_group(self, engines: list["EngineHandle"]) -> GroupSpec:
        self._store = open_store(self.store_host, 0, self.timeout_s)
        workers = self.pool.cfg.engine_tp * len(engines)
        self._spec = GroupSpec(self.store_host, self._store.port, uuid.uuid4().hex[:16], self.source.num_senders, workers,
                               self.backend, self.timeout_s)
        self._members = tuple((e.index, e.incarnation) for e in engines)
        return self._spec

    async def _transfer(self, version: int, engines: list["EngineHandle"]):
        members = tuple((e.index, e.incarnation) for e in engines)
        new = self._spec is None or members != self._members
        if new:
            await self._after_failure()
            self._new_group(engines)
        spec = self._spec
        req = PushRequest("broadcast", version, self.bucket_bytes, self.cfg.verify_checksums, group=spec.to_json())
        info = {"mode": "broadcast", "version": version, "verify": self.cfg.verify_checksums, "session": spec.session}

        async def drive(e: "EngineHandle", offset: int) -> None:
            if new:
                await e.client.init_weight_transfer({"group": spec.to_json(), "receiver_offset": offset}, timeout=_RPC_TIMEOUT_S)
            await e.client.start_weight_update()
            await e.client.update_weights(info, timeout=_RPC_TIMEOUT_S)

        tp = self.pool.cfg.engine_tp
        results = await asyncio.gather(asyncio.to_thread(self.source.push, req),
                                       *(drive(e, i * tp) for i, e in enumerate(engines)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._spec = None  # the group is not reusable after a failed stream
            raise errors[0]
        senders = _check_senders(results[0], spec.num_senders)
        return senders, await _finish_all(engines, version)

    async def _after_failure(self) -> None:
        if self._spec is not None or self._members:
            await asyncio.gather(*(e.client.shutdown_weight_transfer() for e in self.pool.live_engines()), return_exceptions=True)
        self._spec, self._store, self._members = None, None, ()

    async def close(self) -> None:
        await self._after_failure()

    async def raw_broadcast(self, sizes: list[int]) -> tuple[float, int]:
        """Benchmark reference: broadcast `sizes` bytes over the current group with no protocol;
        returns (seconds until every worker has them, bytes)."""
        import json
        import time

        if self._spec is None:
            raise RuntimeError("raw_broadcast needs a group: run one sync first")
        engines = self.pool.live_engines()
        req = PushRequest("raw", -1, group=self._spec.to_json(), raw_sizes=list(sizes))
        t0 = time.perf_counter()
        await asyncio.gather(asyncio.to_thread(self.source.push, req),
                             *(e.client.collective_rpc("mlrl_raw_receive", args=[json.dumps(sizes)], timeout=_RPC_TIMEOUT_S) for e in engines))
        return time.perf_counter() - t0, sum(sizes)


    async def protocol_only(self, version: int) -> float:
        """Benchmark: a full broadcast stream (headers, checksums, verification) that the engines
        receive and drop — the transfer without vLLM's load; returns seconds."""
        import json
        import time

        if self._spec is None:
            raise RuntimeError("protocol_only needs a group: run one sync first")
        req = PushRequest("broadcast", version, self.bucket_bytes, self.cfg.verify_checksums, group=self._spec.to_json())
        info = {"mode": "broadcast", "version": version, "verify": self.cfg.verify_checksums, "session": self._spec.session}
        t0 = time.perf_counter()
        await asyncio.gather(asyncio.to_thread(self.source.push, req),
                             *(e.client.collective_rpc("mlrl_receive_discard", args=[json.dumps(info)], timeout=_RPC_TIMEOUT_S)
                               for e in self.pool.live_engines()))
        return time.perf_counter() - t0


class DiskWeightSync(WeightSync):
    transport = "disk"

    def __init__(self, cfg, pool, source, *, root: Path) -> None:
        super().__init__(cfg, pool, source)
        self.root = Path(root)

    async def _transfer(self, version: int, engines: list["EngineHandle"]):
        out = self.root / f"v{version:08d}"
        if out.exists():
            shutil.rmtree(out)  # a retry or a re-sync of the same version starts from a clean folder
        req = PushRequest("disk", version, self.bucket_bytes, self.cfg.verify_checksums, disk_dir=str(out))
        senders = _check_senders(await asyncio.to_thread(self.source.push, req), self.source.num_senders)
        info = {"mode": "disk", "version": version, "verify": self.cfg.verify_checksums, "disk_dir": str(out),
                "num_senders": self.source.num_senders}

        async def drive(e: "EngineHandle") -> None:
            await e.client.start_weight_update()
            await e.client.update_weights(info, timeout=_RPC_TIMEOUT_S)

        await asyncio.gather(*(drive(e) for e in engines))
        reports = await _finish_all(engines, version)
        for old in self.root.glob("v*"):
            if old != out and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        return senders, reports


class CudaIpcWeightSync(WeightSync):  # pragma: no cover - GPU only (tests/gpu)
    transport = "cuda_ipc"

    async def _transfer(self, version: int, engines: list["EngineHandle"]):
        req = PushRequest("cuda_ipc", version, self.bucket_bytes, self.cfg.verify_checksums)
        senders = _check_senders(await asyncio.to_thread(self.source.push, req), self.source.num_senders)
        info = {"mode": "cuda_ipc", "version": version, "verify": self.cfg.verify_checksums, "senders": [r.ipc for r in senders]}
        try:
            async def drive(e: "EngineHandle") -> None:
                await e.client.start_weight_update()
                await e.client.update_weights(info, timeout=_RPC_TIMEOUT_S)

            await asyncio.gather(*(drive(e) for e in engines))
            reports = await _finish_all(engines, version)
        finally:
            await asyncio.to_thread(self.source.push, PushRequest("cuda_ipc", version, phase="release"))
        for r in senders:
            r.ipc = []  # handles are dead now; keep reports small
        return senders, reports

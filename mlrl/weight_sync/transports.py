"""The three transports, each in its three parts; mlrl.weight_sync.registry binds the names
(`weight_sync.transport`) to them:

    driver      a `WeightSync` subclass: moves the bytes of one sync and finishes the update
                (pausing, verification, canary and retry live in mlrl.weight_sync.sync)
    send        trainer-rank side, called by mlrl.weight_sync.sender.push_from_rank on each
                sender: `send(request, sender, buckets, digest, report)`
    receive     engine-worker side, called by mlrl.weight_sync.receiver.Receiver.receive:
                `receive(worker, update_info, apply, verify) -> per-sender stream summaries`

- broadcast: torch.distributed broadcast (gloo on CPU, NCCL on GPU) from the K trainer senders
  to every engine worker (wire protocol: mlrl.weight_sync.wire). The driver hosts the rendezvous
  store; the group is built on the first sync and rebuilt whenever the set of live engines
  changes (an engine restarted) or an attempt failed. Per engine the driver issues
  /init_weight_transfer_engine (new group only), /start_weight_update, /update_weights — which
  blocks while the worker receives — concurrently with `source.push` in a thread, then
  /finish_weight_update with the version. Senders join (once per session, cached) the
  per-sender group described by `request.group` and stream their buckets.
- disk: the senders write safetensors shards `s<KK>-<iiiii>.safetensors` under <root>/v<version>,
  each with its tensors' checksums in the file metadata, then `s<KK>.done` (written last,
  atomically); engines read them. The newest complete version is kept (older ones deleted), e.g.
  for inspection.
- cuda_ipc (GPU, colocated trainer and engines): the senders export CUDA IPC handles (JSON:
  base64 bytes, no pickle) of their tensors and keep them alive; the engines map and load them;
  then a push with `phase="release"` releases them.

The update_info every driver posts to /update_weights is JSON: {"transport", "version",
"verify", ...transport fields}; its schema on the engine side is MlrlUpdateInfo in rollout/worker_ext.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, cast

import torch

from mlrl.interfaces import EngineHandle
from mlrl.weight_sync.source import BucketFn, PushRequest, SendReport
from mlrl.weight_sync.sync import SyncSetup, WeightSync, _Mismatch, engine_client, gather_all
from mlrl.weight_sync.wire import (
    Channel,
    Digest,
    GroupSpec,
    NamedTensors,
    WireError,
    checksum,
    dtype_from_name,
    dtype_name,
    join_as_sender,
    open_store,
    receive_all,
)

Apply = Callable[[NamedTensors], Any]
_RPC_TIMEOUT_S = 3600.0  # HTTP timeout of calls that block for a whole transfer (the group's own timeout bounds them)


class WorkerState(Protocol):
    """What a transport's receiving part may use of the worker's `mlrl.weight_sync.receiver.Receiver`."""

    device: torch.device
    channels: list[Channel]       # broadcast: the joined per-sender groups
    session: str | None           # broadcast: the joined session

    def close(self) -> None: ...


def _check_senders(reports: list[SendReport], k: int) -> list[SendReport]:
    if sorted(r.sender for r in reports) != list(range(k)):
        raise _Mismatch(
            f"source.push returned reports of senders {sorted(r.sender for r in reports)}, expected 0..{k - 1}"
        )
    return sorted(reports, key=lambda r: r.sender)


async def _finish_all(engines: Sequence[EngineHandle], version: int) -> list[list[dict[str, Any]]]:
    await gather_all(engine_client(e).finish_weight_update(version, timeout=_RPC_TIMEOUT_S) for e in engines)
    reports = await gather_all(engine_client(e).collective_rpc("mlrl_weight_report") for e in engines)
    return [cast(list[dict[str, Any]], r) for r in reports]  # one report per worker of each engine


# ---------------------------------------------------------------------- broadcast


class BroadcastWeightSync(WeightSync):
    transport = "broadcast"

    def __init__(self, cfg, pool, source, setup: SyncSetup, *, timeout_s: float = 600.0) -> None:
        super().__init__(cfg, pool, source, setup)
        host = setup.host
        self.store_host = socket.gethostbyname(socket.gethostname()) if host in ("0.0.0.0", "::") else host
        self.backend = setup.backend if setup.backend is not None else ("nccl" if torch.cuda.is_available() else "gloo")
        self.engine_tp = setup.engine_tp
        self.timeout_s = timeout_s
        self._store = None
        self._spec: GroupSpec | None = None
        self._members: tuple[tuple[int, int], ...] = ()

    @property
    def group(self) -> GroupSpec | None:
        """The current group (None before the first sync and after a failure or `close`)."""
        return self._spec

    def _current(self) -> GroupSpec:
        if self._spec is None:
            raise RuntimeError("broadcast weight sync: no group (none built yet, or the last attempt failed)")
        return self._spec

    def push_request(self, version: int) -> PushRequest:
        """What every trainer rank is asked to do to stream `version` over the current group."""
        return PushRequest(self.transport, version, self.bucket_bytes, self.cfg.verify_checksums,
                           group=self._current().to_json())

    def update_info(self, version: int) -> dict[str, Any]:
        """What every engine is posted to receive `version` over the current group."""
        return {"transport": self.transport, "version": version, "verify": self.cfg.verify_checksums,
                "session": self._current().session}

    def _new_group(self, engines: Sequence[EngineHandle]) -> GroupSpec:
        self._store = open_store(self.store_host, 0, self.timeout_s)
        workers = self.engine_tp * len(engines)
        self._spec = GroupSpec(
            self.store_host,
            self._store.port,
            uuid.uuid4().hex[:16],
            self.source.num_senders,
            workers,
            self.backend,
            self.timeout_s,
        )
        self._members = tuple((e.index, e.incarnation) for e in engines)
        return self._spec

    async def _transfer(self, version: int, engines: Sequence[EngineHandle]):
        members = tuple((e.index, e.incarnation) for e in engines)
        new = self._spec is None or members != self._members
        if new:
            await self._after_failure()
            self._new_group(engines)
        spec = self._current()
        req, info = self.push_request(version), self.update_info(version)

        async def drive(e: EngineHandle, offset: int) -> None:
            if new:
                await engine_client(e).init_weight_transfer(
                    {"group": spec.to_json(), "receiver_offset": offset}, timeout=_RPC_TIMEOUT_S
                )
            await engine_client(e).start_weight_update()
            await engine_client(e).update_weights(info, timeout=_RPC_TIMEOUT_S)

        tp = self.engine_tp
        results = await asyncio.gather(self._push(req),
                                       *(drive(e, i * tp) for i, e in enumerate(engines)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._spec = None  # the group is not reusable after a failed stream
            raise errors[0]
        senders = _check_senders(cast(list[SendReport], results[0]), spec.num_senders)
        return senders, await _finish_all(engines, version)

    async def _after_failure(self) -> None:
        if self._spec is not None or self._members:
            await asyncio.gather(
                *(engine_client(e).shutdown_weight_transfer() for e in self.pool.live_engines()), return_exceptions=True
            )
        self._spec, self._store, self._members = None, None, ()

    async def close(self) -> None:
        await self._after_failure()


_CHANNELS: dict[str, Channel] = {}       # session -> this process's sender channel


def sender_channel(group: dict[str, Any], sender: int) -> Channel:
    """This process's channel as `sender` of the broadcast session `group` (joined once per session)."""
    spec = GroupSpec.from_json(group)
    ch = _CHANNELS.get(spec.session)
    if ch is None:
        for old in list(_CHANNELS):  # a new session replaces the old group (engines restarted / re-joined)
            _CHANNELS.pop(old).close()
        ch = _CHANNELS[spec.session] = join_as_sender(spec, sender)
    return ch


def close_channels() -> None:
    for s in list(_CHANNELS):
        _CHANNELS.pop(s).close()


def send_broadcast(req: PushRequest, sender: int, buckets: BucketFn, digest: Digest, rep: SendReport) -> None:
    group = req.group
    if group is None:
        raise ValueError("PushRequest.group is required for the broadcast transport")
    ch = sender_channel(group, sender)
    try:
        for bucket in buckets(req.bucket_bytes):
            ch.send_bucket(bucket, digest, verify=req.verify)
        ch.send_end(digest)
    except BaseException:
        # never leave the group half-used: tear it down so the receivers fail fast instead of hanging
        _CHANNELS.pop(GroupSpec.from_json(group).session, None)
        ch.close()
        raise


def receive_broadcast_update(worker: WorkerState, info: dict[str, Any], apply: Apply,
                             verify: bool) -> list[dict[str, Any]]:
    try:
        if not worker.channels or info.get("session") != worker.session:
            raise WireError(
                f"broadcast update for session {info.get('session')!r}, but this worker joined {worker.session!r}"
            )
        return receive_all(worker.channels, apply, verify=verify)
    except BaseException:
        worker.close()  # the group is unusable after a failed stream: the driver re-joins
        raise


# ---------------------------------------------------------------------- disk


class DiskWeightSync(WeightSync):
    transport = "disk"

    def __init__(self, cfg, pool, source, setup: SyncSetup) -> None:
        super().__init__(cfg, pool, source, setup)
        if cfg.disk_dir:
            self.root = Path(cfg.disk_dir)
        elif setup.run_dir is not None:
            self.root = Path(setup.run_dir) / "weight_sync"
        else:
            raise ValueError("weight_sync.transport=disk needs weight_sync.disk_dir or a run dir (SyncSetup.run_dir)")

    async def _transfer(self, version: int, engines: Sequence[EngineHandle]):
        out = self.root / f"v{version:08d}"
        if out.exists():
            shutil.rmtree(out)  # a retry or a re-sync of the same version starts from a clean folder
        req = PushRequest(self.transport, version, self.bucket_bytes, self.cfg.verify_checksums, disk_dir=str(out))
        senders = _check_senders(await self._push(req), self.source.num_senders)
        info = {
            "transport": self.transport,
            "version": version,
            "verify": self.cfg.verify_checksums,
            "disk_dir": str(out),
            "num_senders": self.source.num_senders,
        }

        async def drive(e: EngineHandle) -> None:
            await engine_client(e).start_weight_update()
            await engine_client(e).update_weights(info, timeout=_RPC_TIMEOUT_S)

        await gather_all(drive(e) for e in engines)
        reports = await _finish_all(engines, version)
        for old in self.root.glob("v*"):
            if old != out and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        return senders, reports


def send_disk(req: PushRequest, sender: int, buckets: BucketFn, digest: Digest, rep: SendReport) -> None:
    from safetensors.torch import save_file

    if not req.disk_dir:
        raise ValueError("PushRequest.disk_dir is required for the disk transport")
    out = Path(req.disk_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for i, bucket in enumerate(buckets(req.bucket_bytes)):
        tensors, checks = {}, {}
        for name, t in bucket:
            t = t.detach().to("cpu").contiguous()
            c = checksum(t) if req.verify else ""
            tensors[name] = t
            checks[name] = c
            digest.add(name, c, t.numel() * t.element_size())
        fname = f"s{sender:02d}-{i:05d}.safetensors"
        tmp = out / f".{fname}.tmp"
        save_file(
            tensors,
            str(tmp),
            metadata={"mlrl_names": json.dumps([n for n, _ in bucket]), "mlrl_checksums": json.dumps(checks)},
        )
        os.replace(tmp, out / fname)
        files.append(fname)
    done = {"sender": sender, "version": req.version, "files": files, "tensors": digest.tensors, "bytes": digest.bytes,
            "digest": digest.hexdigest()}
    tmp = out / f".s{sender:02d}.done.tmp"
    tmp.write_text(json.dumps(done))
    os.replace(tmp, out / f"s{sender:02d}.done")
    rep.files = files


def receive_disk(root: Path, num_senders: int, apply: Apply, verify: bool = True) -> list[dict[str, Any]]:
    """Read the shards `s<KK>-*.safetensors` every sender wrote under `root` (each sender's `.done` must exist)."""
    from safetensors import safe_open

    out = []
    for s in range(num_senders):
        done_path = root / f"s{s:02d}.done"
        if not done_path.is_file():
            raise WireError(f"disk weight sync: {done_path} is missing (sender {s} did not finish writing)")
        done = json.loads(done_path.read_text())
        d = Digest()
        for fname in done["files"]:
            with safe_open(str(root / fname), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                names = json.loads(meta.get("mlrl_names", "[]")) or list(f.keys())
                checks = json.loads(meta.get("mlrl_checksums", "{}"))
                bucket = []
                for name in names:
                    t = f.get_tensor(name)
                    want = checks.get(name, "")
                    got = checksum(t, want.split(":", 1)[0]) if (verify and want) else want
                    if got != want:
                        raise WireError(
                            f"disk weight sync: checksum mismatch for {name} in {fname}: read {got}, written {want}"
                        )
                    d.add(name, got, t.numel() * t.element_size())
                    bucket.append((name, t))
            apply(bucket)
        if (d.tensors, d.bytes, d.hexdigest()) != (done["tensors"], done["bytes"], done["digest"]):
            raise WireError(f"disk weight sync: sender {s} wrote {done['tensors']} tensors / {done['bytes']} bytes, "
                            f"read back {d.tensors} / {d.bytes} (or the digest differs)")
        out.append({"sender": s, "tensors": d.tensors, "bytes": d.bytes, "digest": d.hexdigest()})
    return out


def receive_disk_update(worker: WorkerState, info: dict[str, Any], apply: Apply, verify: bool) -> list[dict[str, Any]]:
    return receive_disk(Path(info["disk_dir"]), int(info["num_senders"]), apply, verify=verify)


# ---------------------------------------------------------------------- CUDA IPC (GPU only)


class CudaIpcWeightSync(WeightSync):  # pragma: no cover - GPU only (tests/gpu)
    transport = "cuda_ipc"

    async def _transfer(self, version: int, engines: Sequence[EngineHandle]):
        req = PushRequest(self.transport, version, self.bucket_bytes, self.cfg.verify_checksums)
        # not `self._push`: the trainer is called again (release) once the engines loaded, and a
        # deferred canary reference must not run into that call
        senders = _check_senders(await asyncio.to_thread(self.source.push, req), self.source.num_senders)
        info = {"transport": self.transport, "version": version, "verify": self.cfg.verify_checksums,
                "senders": [r.ipc for r in senders]}
        try:
            async def drive(e: EngineHandle) -> None:
                await engine_client(e).start_weight_update()
                await engine_client(e).update_weights(info, timeout=_RPC_TIMEOUT_S)

            await gather_all(drive(e) for e in engines)
            reports = await _finish_all(engines, version)
        finally:
            await asyncio.to_thread(self.source.push, PushRequest(self.transport, version, phase="release"))
        for r in senders:
            r.ipc = []  # handles are dead now; keep reports small
        return senders, reports


_IPC_KEEPALIVE: dict[int, list[torch.Tensor]] = {}  # version -> tensors whose handles are exported


def ipc_handle_json(t: torch.Tensor) -> dict[str, Any]:  # pragma: no cover - GPU only
    """JSON form of torch.multiprocessing.reductions.reduce_tensor(t) for a CUDA tensor (bytes as base64)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    (_, size, stride, offset, _, dtype, device, handle, storage_size, storage_offset, requires_grad,
     ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = cast(tuple[Any, ...], args)
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    return {"size": list(size), "stride": list(stride), "offset": offset, "dtype": dtype_name(dtype), "device": device,
            "handle": b64(handle), "storage_size": storage_size, "storage_offset": storage_offset,
            "ref_counter_handle": b64(ref_counter_handle), "ref_counter_offset": ref_counter_offset,
            "event_handle": b64(event_handle), "event_sync_required": bool(event_sync_required),
            "gpu_uuid": str(torch.cuda.get_device_properties(device).uuid)}


def send_ipc(
    req: PushRequest, sender: int, buckets: BucketFn, digest: Digest, rep: SendReport
) -> None:  # pragma: no cover
    keep = _IPC_KEEPALIVE.setdefault(req.version, [])
    out = []
    for bucket in buckets(req.bucket_bytes):
        metas = []
        for name, t in bucket:
            t = t.detach().contiguous()
            if t.device.type != "cuda":
                raise ValueError(f"cuda_ipc transport: tensor {name} is on {t.device}, expected a CUDA device")
            keep.append(t)
            c = checksum(t) if req.verify else ""
            digest.add(name, c, t.numel() * t.element_size())
            metas.append({"name": name, "checksum": c, "handle": ipc_handle_json(t)})
        out.append(metas)
    torch.cuda.synchronize()
    rep.ipc = out


def release_ipc() -> None:
    """Phase "release": the engines loaded the tensors; drop the references that kept the handles valid."""
    _IPC_KEEPALIVE.clear()


def rebuild_ipc_tensor(h: dict[str, Any], device_index: int) -> torch.Tensor:  # pragma: no cover - GPU only
    """Inverse of `ipc_handle_json` on the receiving process."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if str(torch.cuda.get_device_properties(device_index).uuid) != h["gpu_uuid"]:
        raise WireError(
            f"cuda_ipc: handle is for GPU {h['gpu_uuid']}, this worker is on another GPU (colocate engines with the "
            "trainer)"
        )
    b = base64.b64decode
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(h["size"]),
        tuple(h["stride"]),
        h["offset"],
        torch.storage.TypedStorage,
        dtype_from_name(h["dtype"]),
        device_index,
        b(h["handle"]),
        h["storage_size"],
        h["storage_offset"],
        False,
        b(h["ref_counter_handle"]),
        h["ref_counter_offset"],
        b(h["event_handle"]),
        h["event_sync_required"],
    )


def receive_ipc(
    senders: list[list[list[dict[str, Any]]]], apply: Apply, device: torch.device, verify: bool = True
) -> list[dict[str, Any]]:  # pragma: no cover
    out = []
    for s, buckets in enumerate(senders):
        d = Digest()
        for metas in buckets:
            bucket = []
            for m in metas:
                t = rebuild_ipc_tensor(m["handle"], device.index or 0)
                got = checksum(t, m["checksum"].split(":", 1)[0]) if (verify and m["checksum"]) else m["checksum"]
                if got != m["checksum"]:
                    raise WireError(f"cuda_ipc: checksum mismatch for {m['name']}")
                d.add(m["name"], got, t.numel() * t.element_size())
                bucket.append((m["name"], t))
            apply(bucket)
        out.append({"sender": s, "tensors": d.tensors, "bytes": d.bytes, "digest": d.hexdigest()})
    return out


def receive_ipc_update(worker: WorkerState, info: dict[str, Any], apply: Apply,
                       verify: bool) -> list[dict[str, Any]]:  # pragma: no cover
    return receive_ipc(info["senders"], apply, worker.device, verify=verify)

"""Trainer-rank side of every transport: what one trainer process does for one push.

The driver sends the same `PushRequest` (JSON) to every trainer rank; each rank calls

    push_from_rank(request, buckets, sender)

where `buckets(bucket_bytes)` yields this rank's weights as HF-named full tensors grouped in
buckets, and `sender` is this rank's sender index (0..K-1; one sender per pipeline stage, e.g.
the rank with tp = dp = cp = 0 of each stage) or None on ranks that do not send. Non-sending ranks
still iterate `buckets` so that the collectives producing the full tensors (TP all-gather, EP
gather) stay aligned across ranks; they send nothing. Each sender returns a `SendReport`
(counts, checksum digest) that the driver compares with what the engines report.

Transports (`PushRequest.transport`):
- "broadcast": join (once per session, cached) the per-sender group described by
  `request.group` and stream the buckets (mlrl.weight_sync.wire);
- "disk": write safetensors shards `s<KK>-<iiiii>.safetensors` under `request.disk_dir`, each
  with its tensors' checksums in the file metadata, then `s<KK>.done` (written last, atomically);
- "cuda_ipc" (GPU only): export CUDA IPC handles (JSON: base64 bytes, no pickle) of every
  tensor and keep the tensors alive until a push with `phase="release"`;
- "raw": broadcast `raw_sizes` bytes over the same group with no protocol (the benchmark's
  reference for the wire speed).
"""

from __future__ import annotations

import base64
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

import torch

from mlrl.weight_sync.wire import Channel, Digest, GroupSpec, NamedTensors, checksum, dtype_name, join_as_sender

Transport = Literal["broadcast", "disk", "cuda_ipc", "raw"]
BucketFn = Callable[[int], Iterable[NamedTensors]]


@dataclass
class PushRequest:
    """What the driver asks every trainer rank to do for one sync (JSON-serialisable)."""

    transport: Transport
    version: int
    bucket_bytes: int = 64 << 20
    verify: bool = True                   # compute per-tensor checksums
    group: dict[str, Any] | None = None   # GroupSpec.to_json() (broadcast, raw)
    disk_dir: str | None = None           # disk: folder of this version's shards
    phase: Literal["send", "release"] = "send"  # cuda_ipc: export handles, or release them after the engines loaded
    raw_sizes: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: "dict[str, Any] | PushRequest") -> "PushRequest":
        return d if isinstance(d, PushRequest) else cls(**d)


@dataclass
class SendReport:
    """What one sender pushed."""

    sender: int
    transport: str
    tensors: int = 0
    bytes: int = 0
    digest: str = ""
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)       # disk
    ipc: list[list[dict[str, Any]]] = field(default_factory=list)  # cuda_ipc: buckets of exported handles

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: "dict[str, Any] | SendReport") -> "SendReport":
        return d if isinstance(d, SendReport) else cls(**d)


def bucketize(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    """Group (name, tensor) pairs into buckets of at most `bucket_bytes` (a larger tensor gets its own bucket)."""
    bucket: NamedTensors = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


_CHANNELS: dict[str, Channel] = {}       # session -> this process's sender channel
_IPC_KEEPALIVE: dict[int, list[torch.Tensor]] = {}  # version -> tensors whose handles are exported


def _channel(group: dict[str, Any], sender: int) -> Channel:
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


def push_from_rank(request: "PushRequest | dict[str, Any]", buckets: BucketFn, sender: int | None) -> SendReport | None:
    """Run this rank's part of one push (see the module docstring). Returns None on non-sending ranks."""
    req = PushRequest.from_json(request)
    t0 = time.perf_counter()
    if req.transport == "cuda_ipc" and req.phase == "release":
        _IPC_KEEPALIVE.clear()
        return None if sender is None else SendReport(sender, req.transport)
    if req.transport == "raw":
        if sender is None:
            return None
        ch = _channel(req.group, sender)
        src = torch.empty(max(req.raw_sizes, default=0), dtype=torch.uint8, device=ch.device)
        n = ch.raw_broadcast(req.raw_sizes, src)
        return SendReport(sender, "raw", bytes=n, seconds=time.perf_counter() - t0)
    if sender is None:
        for _ in buckets(req.bucket_bytes):  # keep trainer-side collectives aligned
            pass
        return None
    digest = Digest()
    rep = SendReport(sender, req.transport)
    if req.transport == "broadcast":
        ch = _channel(req.group, sender)
        try:
            for bucket in buckets(req.bucket_bytes):
                ch.send_bucket(bucket, digest, verify=req.verify)
            ch.send_end(digest)
        except BaseException:
            # never leave the group half-used: tear it down so the receivers fail fast instead of hanging
            _CHANNELS.pop(GroupSpec.from_json(req.group).session, None)
            ch.close()
            raise
    elif req.transport == "disk":
        rep.files = _write_disk(req, sender, buckets, digest)
    elif req.transport == "cuda_ipc":  # pragma: no cover - GPU only
        rep.ipc = _export_ipc(req, buckets, digest)
    else:
        raise ValueError(f"PushRequest.transport: unknown {req.transport!r} (expected broadcast, disk, cuda_ipc or raw)")
    rep.tensors, rep.bytes, rep.digest = digest.tensors, digest.bytes, digest.hexdigest()
    rep.seconds = time.perf_counter() - t0
    return rep


# ---------------------------------------------------------------------- disk


def _write_disk(req: PushRequest, sender: int, buckets: BucketFn, digest: Digest) -> list[str]:
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
        save_file(tensors, str(tmp), metadata={"mlrl_names": json.dumps([n for n, _ in bucket]), "mlrl_checksums": json.dumps(checks)})
        os.replace(tmp, out / fname)
        files.append(fname)
    done = {"sender": sender, "version": req.version, "files": files, "tensors": digest.tensors, "bytes": digest.bytes,
            "digest": digest.hexdigest()}
    tmp = out / f".s{sender:02d}.done.tmp"
    tmp.write_text(json.dumps(done))
    os.replace(tmp, out / f"s{sender:02d}.done")
    return files


# ---------------------------------------------------------------------- CUDA IPC (GPU only)


def ipc_handle_json(t: torch.Tensor) -> dict[str, Any]:  # pragma: no cover - GPU only
    """JSON form of torch.multiprocessing.reductions.reduce_tensor(t) for a CUDA tensor (bytes as base64)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    (_, size, stride, offset, _, dtype, device, handle, storage_size, storage_offset, requires_grad,
     ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    return {"size": list(size), "stride": list(stride), "offset": offset, "dtype": dtype_name(dtype), "device": device,
            "handle": b64(handle), "storage_size": storage_size, "storage_offset": storage_offset,
            "ref_counter_handle": b64(ref_counter_handle), "ref_counter_offset": ref_counter_offset,
            "event_handle": b64(event_handle), "event_sync_required": bool(event_sync_required),
            "gpu_uuid": str(torch.cuda.get_device_properties(device).uuid)}


def _export_ipc(req: PushRequest, buckets: BucketFn, digest: Digest) -> list[list[dict[str, Any]]]:  # pragma: no cover
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
    return out

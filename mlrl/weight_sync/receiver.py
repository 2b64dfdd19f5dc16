"""Engine-worker side of every transport, without vLLM: turn one update into buckets of
(HF name, tensor) handed to an `apply` callback, and report what arrived.

`mlrl.rollout.worker_ext` (inside vLLM's worker) owns a `Receiver` and passes the model's
`load_weights` as `apply`; tests drive the same class with a plain dict as the "model". The
report (JSON) holds, per sender, the tensor count, byte count and the digest of the checksums
this worker recomputed from the bytes it received, to be compared by the driver with the
senders' `SendReport`s.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from mlrl.weight_sync.wire import Channel, Digest, GroupSpec, NamedTensors, WireError, checksum, dtype_from_name, join_as_receiver, receive_all

Apply = Callable[[NamedTensors], Any]


class Receiver:
    """Receives weight updates for one worker; holds the broadcast channels between syncs."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.channels: list[Channel] = []
        self.session: str | None = None

    def join(self, group: dict[str, Any], receiver: int) -> None:
        """Join the per-sender groups of a broadcast session (blocks until every member joined)."""
        self.close()
        spec = GroupSpec.from_json(group)
        self.channels = join_as_receiver(spec, receiver, self.device if spec.backend == "nccl" else torch.device("cpu"))
        self.session = spec.session

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        self.channels = []
        self.session = None

    def receive(self, info: dict[str, Any], apply: Apply) -> dict[str, Any]:
        """One update (`info` is the JSON update_info the driver posted). Raises on any mismatch."""
        t0 = time.perf_counter()
        mode = info.get("mode")
        verify = bool(info.get("verify", True))
        if mode == "broadcast":
            if not self.channels or info.get("session") != self.session:
                raise WireError(f"broadcast update for session {info.get('session')!r}, but this worker joined {self.session!r}")
            streams = receive_all(self.channels, apply, verify=verify)
        elif mode == "disk":
            streams = receive_disk(Path(info["disk_dir"]), int(info["num_senders"]), apply, verify=verify)
        elif mode == "cuda_ipc":  # pragma: no cover - GPU only
            streams = receive_ipc(info["senders"], apply, self.device, verify=verify)
        else:
            raise WireError(f"update_info.mode: unknown {mode!r} (expected broadcast, disk or cuda_ipc)")
        return {"mode": mode, "version": info.get("version"), "streams": streams, "seconds": time.perf_counter() - t0}

    def receive_discard(self, info: dict[str, Any]) -> dict[str, Any]:
        """Benchmark: a full protocol stream (headers, checksums, verification) whose buckets are dropped."""
        return self.receive(info, lambda bucket: None)

    def receive_raw(self, sizes: list[int]) -> dict[str, Any]:
        """Benchmark reference: the same bytes over the same group, no protocol, nothing applied."""
        t0 = time.perf_counter()
        n = self.channels[0].raw_broadcast(sizes) if self.channels else 0
        return {"bytes": n, "seconds": time.perf_counter() - t0}


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
                        raise WireError(f"disk weight sync: checksum mismatch for {name} in {fname}: read {got}, written {want}")
                    d.add(name, got, t.numel() * t.element_size())
                    bucket.append((name, t))
            apply(bucket)
        if (d.tensors, d.bytes, d.hexdigest()) != (done["tensors"], done["bytes"], done["digest"]):
            raise WireError(f"disk weight sync: sender {s} wrote {done['tensors']} tensors / {done['bytes']} bytes, "
                            f"read back {d.tensors} / {d.bytes} (or the digest differs)")
        out.append({"sender": s, "tensors": d.tensors, "bytes": d.bytes, "digest": d.hexdigest()})
    return out


def rebuild_ipc_tensor(h: dict[str, Any], device_index: int) -> torch.Tensor:  # pragma: no cover - GPU only
    """Inverse of mlrl.weight_sync.sender.ipc_handle_json on the receiving process."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if str(torch.cuda.get_device_properties(device_index).uuid) != h["gpu_uuid"]:
        raise WireError(f"cuda_ipc: handle is for GPU {h['gpu_uuid']}, this worker is on another GPU (colocate engines with the trainer)")
    b = base64.b64decode
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(h["size"]), tuple(h["stride"]), h["offset"], torch.storage.TypedStorage,
                               dtype_from_name(h["dtype"]), device_index, b(h["handle"]), h["storage_size"], h["storage_offset"],
                               False, b(h["ref_counter_handle"]), h["ref_counter_offset"], b(h["event_handle"]),
                               h["event_sync_required"])


def receive_ipc(senders: list[list[list[dict[str, Any]]]], apply: Apply, device: torch.device, verify: bool = True) -> list[dict[str, Any]]:  # pragma: no cover
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


"""Wire protocol of the broadcast weight sync: the process groups and the per-sender tensor stream.

Torch only (no vllm, no megatron): the same code runs on the trainer's sending ranks, in the
driver (which hosts the rendezvous store) and inside vLLM's workers (the receiver).

Group layout for K senders (one per trainer pipeline stage) and W receivers (every worker of
every engine): one rendezvous (a `TCPStore` hosted by the driver, keys prefixed by a session id)
and one stateless process group PER SENDER, holding that sender (group rank 0) and all W
receivers (group ranks 1..W). A gloo/NCCL broadcast involves every member of its group, so a
single K+W group would make each sender receive every other stage's weights; per-sender groups
send each byte exactly once. Receivers drain the senders in order 0..K-1; senders stream
concurrently and simply block until the receivers reach them.

Stream of one sender, repeated per bucket (a bucket = up to `bucket_bytes` of tensors):
    1. int64[1]             length L of the header
    2. uint8[L]             header: UTF-8 JSON (never pickle) {"p": 1, "end": false,
                            "tensors": [{"name", "dtype", "shape", "checksum"}, ...]}
    3. uint8[nbytes] x N    each tensor's bytes, one broadcast per tensor (no packing copy; the
                            bytes are broadcast as uint8 so every dtype travels unchanged)
and finally a header {"p": 1, "end": true, "tensors": n, "bytes": b, "digest": d}.
`digest` = sha256 over "name\\tchecksum\\n" lines in stream order; receivers recompute every
checksum from the bytes they got and report their own digest per sender, so the driver can
compare what each engine received with what was sent.

Checksums: CRC-32 of the bytes on CPU ("crc32:<hex>", ~2 GB/s, zlib releases the GIL); on CUDA a
position-weighted 64-bit sum computed on the device ("fl64:<hex>") to avoid a device->host copy.
The receiver uses the algorithm named by the sender.

Use the process-group objects' own methods (`pg.broadcast([t], opts).wait()`):
`torch.distributed.broadcast(group=...)` does not work for a stateless group (measured).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.distributed import BroadcastOptions, PrefixStore, TCPStore

PROTOCOL = 1
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}

NamedTensors = list[tuple[str, torch.Tensor]]


class WireError(RuntimeError):
    """The stream did not follow the protocol (wrong version, bad header, checksum mismatch)."""


@dataclass(frozen=True)
class GroupSpec:
    """Where and how senders and receivers meet; JSON-serialisable (it travels over HTTP to the engines)."""

    host: str             # address of the rendezvous store (the driver)
    port: int
    session: str          # unique per group incarnation: keys of older sessions are never reused
    num_senders: int      # K
    num_receivers: int    # W: every worker of every engine
    backend: str = "gloo"  # "gloo" (CPU tensors) or "nccl" (CUDA tensors)
    timeout_s: float = 600.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "GroupSpec":
        return cls(**d)


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise WireError(f"unsupported dtype {name!r} in weight-sync header (known: {', '.join(_DTYPES)})") from None


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise WireError(f"cannot send dtype {dtype}")
    return name


# ---------------------------------------------------------------------- checksums


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _fletcher64(b: torch.Tensor) -> str:
    pad = (-b.numel()) % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    w = b.view(torch.int64)
    pos = torch.arange(w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
    s1 = int(w.sum().item()) & 0xFFFFFFFFFFFFFFFF
    s2 = int((w * pos).sum().item()) & 0xFFFFFFFFFFFFFFFF
    return f"fl64:{s1:016x}{s2:016x}"


def checksum(t: torch.Tensor, algo: str | None = None) -> str:
    """Checksum of a tensor's bytes: "crc32:..." (default on CPU) or "fl64:..." (default on CUDA)."""
    b = _as_bytes(t)
    algo = algo or ("crc32" if b.device.type == "cpu" else "fl64")
    if algo == "crc32":
        return f"crc32:{zlib.crc32(b.cpu().numpy()):08x}"
    if algo == "fl64":
        return _fletcher64(b)
    raise WireError(f"unknown checksum algorithm {algo!r}")


class Digest:
    """Running digest of a stream: sha256 over "name\\tchecksum\\n" lines, plus counts."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.tensors = 0
        self.bytes = 0

    def add(self, name: str, check: str, nbytes: int) -> None:
        self._h.update(f"{name}\t{check}\n".encode())
        self.tensors += 1
        self.bytes += nbytes

    def hexdigest(self) -> str:
        return self._h.hexdigest()


# ---------------------------------------------------------------------- groups


def open_store(host: str, port: int = 0, timeout_s: float = 600.0) -> TCPStore:
    """The rendezvous store (driver side). port=0 picks a free port: read it back from `.port`."""
    return TCPStore(host, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                    timeout=datetime.timedelta(seconds=timeout_s))


def _device_for(host: str):
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    if host in ("127.0.0.1", "localhost", "::1"):
        return ProcessGroupGloo.create_device(hostname=host)  # stay on loopback
    return ProcessGroupGloo.create_default_device()


def _new_group(spec: GroupSpec, store, sender: int, rank: int):
    prefix = PrefixStore(f"mlrl-ws/{spec.session}/s{sender}", store)
    size = 1 + spec.num_receivers
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if spec.backend == "gloo":
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [_device_for(spec.host)]
        return ProcessGroupGloo(prefix, rank, size, opts)
    if spec.backend == "nccl":  # pragma: no cover - GPU only
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(prefix, rank, size, opts)
    raise WireError(f"unknown weight-sync backend {spec.backend!r} (expected gloo or nccl)")


def _client_store(spec: GroupSpec) -> TCPStore:
    return TCPStore(spec.host, spec.port, is_master=False, timeout=datetime.timedelta(seconds=spec.timeout_s))


class Channel:
    """One sender's group as seen by one member. `device` is where tensors travel (cpu for gloo)."""

    def __init__(self, pg, device: torch.device, store=None) -> None:
        self.pg = pg
        self.device = device
        self._store = store  # keep the client connection alive as long as the group

    def _bcast(self, t: torch.Tensor) -> None:
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.pg.broadcast([t], opts).wait()

    # sender side -----------------------------------------------------------

    def send_bucket(self, named: NamedTensors, digest: Digest, verify: bool = True) -> None:
        metas, payloads = [], []
        for name, t in named:
            b = _as_bytes(t.to(self.device))
            check = checksum(b) if verify else ""
            metas.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "checksum": check})
            payloads.append(b)
            digest.add(name, check, b.numel())
        self._send_header({"p": PROTOCOL, "end": False, "tensors": metas})
        for b in payloads:
            if b.numel():
                self._bcast(b)

    def send_end(self, digest: Digest) -> None:
        self._send_header({"p": PROTOCOL, "end": True, "tensors": digest.tensors, "bytes": digest.bytes,
                           "digest": digest.hexdigest()})

    def _send_header(self, header: dict[str, Any]) -> None:
        raw = json.dumps(header, separators=(",", ":")).encode()
        self._bcast(torch.tensor([len(raw)], dtype=torch.int64, device=self.device))
        self._bcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device))

    # receiver side ---------------------------------------------------------

    def _recv_header(self) -> dict[str, Any]:
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._bcast(n)
        size = int(n.item())
        if not 0 < size < (1 << 31):
            raise WireError(f"weight-sync header length {size} out of range")
        raw = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._bcast(raw)
        try:
            header = json.loads(bytes(raw.cpu().numpy()).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WireError(f"weight-sync header is not JSON: {e}") from e
        if header.get("p") != PROTOCOL:
            raise WireError(f"weight-sync protocol {header.get('p')!r}, this receiver speaks {PROTOCOL}")
        return header

    def recv_stream(self, digest: Digest, verify: bool = True) -> Iterator[NamedTensors]:
        """Yield the buckets of this sender's stream; checks every checksum and the final summary."""
        while True:
            header = self._recv_header()
            if header["end"]:
                if (header["tensors"], header["bytes"]) != (digest.tensors, digest.bytes):
                    raise WireError(f"stream ended after {digest.tensors} tensors / {digest.bytes} bytes, "
                                    f"sender says {header['tensors']} / {header['bytes']}")
                if header["digest"] != digest.hexdigest():
                    raise WireError("stream digest differs from the sender's")
                return
            bucket: NamedTensors = []
            for m in header["tensors"]:
                dtype = dtype_from_name(m["dtype"])
                shape = [int(s) for s in m["shape"]]
                numel = 1
                for s in shape:
                    numel *= s
                nbytes = numel * torch.empty((), dtype=dtype).element_size()
                b = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                if nbytes:
                    self._bcast(b)
                got = ""
                if verify and m["checksum"]:
                    got = checksum(b, m["checksum"].split(":", 1)[0])
                    if got != m["checksum"]:
                        raise WireError(f"checksum mismatch for {m['name']}: received {got}, sender sent {m['checksum']}")
                digest.add(m["name"], got if verify else m["checksum"], nbytes)
                bucket.append((m["name"], b.view(dtype).reshape(shape)))
            yield bucket

    # raw (benchmark reference: the same bytes, no protocol) -----------------

    def raw_broadcast(self, sizes: Iterable[int], src: torch.Tensor | None = None) -> int:
        total = 0
        for n in sizes:
            buf = src[:n] if src is not None else torch.empty(n, dtype=torch.uint8, device=self.device)
            self._bcast(buf)
            total += n
        return total

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "abort"):
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - best effort teardown
                pass
        self._store = None


def join_as_sender(spec: GroupSpec, sender: int) -> Channel:
    if not 0 <= sender < spec.num_senders:
        raise WireError(f"sender index {sender} out of range for {spec.num_senders} senders")
    store = _client_store(spec)
    device = torch.device("cuda", torch.cuda.current_device()) if spec.backend == "nccl" else torch.device("cpu")
    return Channel(_new_group(spec, store, sender, 0), device, store)


def join_as_receiver(spec: GroupSpec, receiver: int, device: torch.device | None = None) -> list[Channel]:
    """Join every sender's group, in sender order (all receivers must use the same order)."""
    if not 0 <= receiver < spec.num_receivers:
        raise WireError(f"receiver index {receiver} out of range for {spec.num_receivers} receivers")
    store = _client_store(spec)
    dev = device or torch.device("cpu")
    return [Channel(_new_group(spec, store, s, 1 + receiver), dev, store) for s in range(spec.num_senders)]


def receive_all(channels: list[Channel], apply: Callable[[NamedTensors], Any], verify: bool = True) -> list[dict[str, Any]]:
    """Drain every sender's stream in order, calling `apply(bucket)`; one summary per sender."""
    out = []
    for s, ch in enumerate(channels):
        d = Digest()
        for bucket in ch.recv_stream(d, verify=verify):
            apply(bucket)
        out.append({"sender": s, "tensors": d.tensors, "bytes": d.bytes, "digest": d.hexdigest()})
    return out

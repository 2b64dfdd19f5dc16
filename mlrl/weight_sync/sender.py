"""Trainer-rank side of every transport: what one trainer process does for one push.

The driver sends the same `PushRequest` (JSON) to every trainer rank; each rank calls

    push_from_rank(request, buckets, sender)

where `buckets(bucket_bytes)` yields this rank's weights as HF-named full tensors grouped in
buckets, and `sender` is this rank's sender index (0..K-1; one sender per pipeline stage, e.g.
the rank with tp = dp = cp = 0 of each stage) or None on ranks that do not send. Non-sending ranks
still iterate `buckets` so that the collectives producing the full tensors (TP all-gather, EP
gather) stay aligned across ranks; they send nothing. Each sender returns a `SendReport`
(counts, checksum digest) that the driver compares with what the engines report.

`request.transport` names the transport (mlrl.weight_sync.registry); its `send` part does the
work (mlrl.weight_sync.transports: broadcast streams over the session's groups, disk writes
safetensors shards, cuda_ipc exports handles). A request with `phase="release"` runs the
transport's `release` part instead (cuda_ipc: the engines loaded the exported tensors).
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Iterator

import torch

from mlrl.weight_sync.registry import transport
from mlrl.weight_sync.source import BucketFn, PushRequest, SendReport
from mlrl.weight_sync.wire import Digest, NamedTensors


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


def push_from_rank(request: "PushRequest | dict[str, Any]", buckets: BucketFn, sender: int | None) -> SendReport | None:
    """Run this rank's part of one push (see the module docstring). Returns None on non-sending ranks."""
    req = PushRequest.from_json(request)
    parts = transport(req.transport)
    t0 = time.perf_counter()
    if req.phase == "release":
        if parts.release is None:
            raise ValueError(f"PushRequest.phase='release': the {req.transport} transport keeps nothing to release")
        parts.release()
        return None if sender is None else SendReport(sender, req.transport)
    if sender is None:
        for _ in buckets(req.bucket_bytes):  # keep trainer-side collectives aligned
            pass
        return None
    digest = Digest()
    rep = SendReport(sender, req.transport)
    made: list[Iterator[NamedTensors]] = []

    def tracked(bucket_bytes: int) -> Iterator[NamedTensors]:
        made.append(iter(buckets(bucket_bytes)))
        return made[-1]

    try:
        parts.send(req, sender, tracked, digest, rep)
    except Exception:
        # the sender's TP / EP peers are still gathering their share of every tensor: walk the rest of
        # this rank's iterator too (its collectives only, nothing sent), so that they finish and every
        # rank answers the driver, which retries; else they waited out the process group's timeout
        try:
            for _ in made[-1] if made else iter(buckets(req.bucket_bytes)):
                pass
        except Exception:  # the transport's error is the one to report
            pass
        raise
    rep.tensors, rep.bytes, rep.digest = digest.tensors, digest.bytes, digest.hexdigest()
    rep.seconds = time.perf_counter() - t0
    return rep

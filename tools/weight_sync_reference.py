"""The reference measurements of tools/bench_weight_sync.py: benchmark only, outside the sync path
(kept out of the `mlrl` package; tests load it with `helpers.tools.load_tool`).

Both run over the group of a `BroadcastWeightSync` that has done one sync, side by side with it:
- raw: the same tensor byte sizes broadcast with no protocol — no headers, no checksums, nothing
  applied: the wire's speed on this machine. The sending side is THIS process as sender 0 (an
  in-process one-sender source such as tools/hf_weight_source.py's, which joined the group in that sync).
- protocol only: the full broadcast stream (headers, checksums on both ends, verification),
  pushed through `ws.source` and received and dropped by the engines: the transfer without
  vLLM's load.

The engine workers' side (`on_worker`) is reached through collective_rpc `mlrl_bench_reference`,
the one method that tools/weight_sync_reference_ext.py's worker extension adds to mlrl's. Engines
get that extension only when the pool is built with `server_factory=engine_server`, which also puts
tools/ on the engine's PYTHONPATH (vLLM imports the extension by its dotted name inside the engine).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from mlrl.rollout.server import EngineServer, ServerSpec
from mlrl.weight_sync.receiver import Receiver
from mlrl.weight_sync.sync import engine_client
from mlrl.weight_sync.transports import _RPC_TIMEOUT_S, BroadcastWeightSync, sender_channel
from mlrl.weight_sync.wire import Channel

TOOLS = Path(__file__).resolve().parent
WORKER_EXTENSION = "weight_sync_reference_ext.ReferenceWorkerExtension"  # importable with TOOLS on sys.path
WORKER_HOOK = "mlrl_bench_reference"  # its method; the one argument is the JSON `call` of on_worker


def engine_server(index: int, spec: ServerSpec) -> EngineServer:
    """`EnginePool(server_factory=...)`: engine `index` as the pool would start it, with the worker
    extension that has the reference hook and tools/ first on the engine's PYTHONPATH."""
    path = spec.extra_env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    env = {**spec.extra_env, "PYTHONPATH": os.pathsep.join(p for p in (str(TOOLS), path) if p)}
    return EngineServer(dataclasses.replace(spec, worker_extension=WORKER_EXTENSION, extra_env=env))


def _raw_broadcast(ch: Channel, sizes: Iterable[int], src: torch.Tensor | None = None) -> int:
    total = 0
    for n in sizes:
        buf = src[:n] if src is not None else torch.empty(n, dtype=torch.uint8, device=ch.device)
        ch._bcast(buf)
        total += n
    return total


def send_raw(group: dict[str, Any], sizes: list[int], sender: int = 0) -> int:
    """Sending side of raw: broadcast `sizes` bytes over this process's channel of `group`."""
    ch = sender_channel(group, sender)
    src = torch.empty(max(sizes, default=0), dtype=torch.uint8, device=ch.device)
    return _raw_broadcast(ch, sizes, src)


def on_worker(receiver: Receiver, call: dict[str, Any]) -> dict[str, Any]:
    """Engine-worker side, on the worker's joined group: {"op": "raw", "sizes": [...]} or
    {"op": "discard", "info": update_info} (a full update whose buckets are dropped; the model is untouched)."""
    op = call.get("op")
    if op == "raw":
        t0 = time.perf_counter()
        n = _raw_broadcast(receiver.channels[0], [int(s) for s in call["sizes"]]) if receiver.channels else 0
        return {"bytes": n, "seconds": time.perf_counter() - t0}
    if op == "discard":
        return receiver.receive(call["info"], lambda bucket: None)
    raise ValueError(f"weight_sync_reference.on_worker: unknown op {op!r} (expected raw or discard)")


async def _on_engines(ws: BroadcastWeightSync, call: dict[str, Any]) -> list[Any]:
    return await asyncio.gather(*(engine_client(e).collective_rpc(WORKER_HOOK, args=[json.dumps(call)],
                                                                  timeout=_RPC_TIMEOUT_S)
                                  for e in ws.pool.live_engines()))


async def raw_broadcast(ws: BroadcastWeightSync, sizes: list[int]) -> tuple[float, int]:
    """Broadcast `sizes` bytes over `ws`'s current group with no protocol; returns (seconds until
    every worker has them, bytes)."""
    if ws.group is None:
        raise RuntimeError("raw_broadcast needs a group: run one sync first")
    if ws.source.num_senders != 1:
        raise RuntimeError(f"raw_broadcast sends from this process as sender 0: needs a one-sender source, "
                           f"got {ws.source.num_senders} senders")
    t0 = time.perf_counter()
    await asyncio.gather(asyncio.to_thread(send_raw, ws.group.to_json(), list(sizes), 0),
                         _on_engines(ws, {"op": "raw", "sizes": list(sizes)}))
    return time.perf_counter() - t0, sum(sizes)


async def protocol_only(ws: BroadcastWeightSync, version: int) -> float:
    """A full broadcast stream (headers, checksums, verification) that the engines receive and
    drop — the transfer without vLLM's load; returns seconds."""
    if ws.group is None:
        raise RuntimeError("protocol_only needs a group: run one sync first")
    req, info = ws.push_request(version), ws.update_info(version)
    t0 = time.perf_counter()
    await asyncio.gather(asyncio.to_thread(ws.source.push, req), _on_engines(ws, {"op": "discard", "info": info}))
    return time.perf_counter() - t0

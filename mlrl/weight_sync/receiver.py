"""Engine-worker side of every transport, without vLLM: turn one update into buckets of
(HF name, tensor) handed to an `apply` callback, and report what arrived.

The rollout package's worker extension (rollout/worker_ext.py, inside vLLM's worker) owns a
`Receiver` and passes the model's `load_weights` as `apply`; tests drive the same class with a
plain dict as the "model". The update_info's "transport" names the transport
(mlrl.weight_sync.registry), whose `receive` part does the work (mlrl.weight_sync.transports).
The report (JSON) holds, per sender, the tensor count, byte count and the digest of the
checksums this worker recomputed from the bytes it received, to be compared by the driver with
the senders' `SendReport`s.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mlrl.weight_sync.registry import transport
from mlrl.weight_sync.transports import Apply
from mlrl.weight_sync.wire import Channel, GroupSpec, join_as_receiver


class Receiver:
    """Receives weight syncs for one worker; holds the broadcast channels between syncs."""

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
        name = info.get("transport")
        streams = transport(name).receive(self, info, apply, bool(info.get("verify", True)))
        return {"transport": name, "version": info.get("version"), "streams": streams,
                "seconds": time.perf_counter() - t0}

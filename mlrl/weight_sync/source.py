"""The trainer as the weight sync sees it: `WeightSource`, and what crosses that seam
(`PushRequest` from the driver to every trainer rank, `SendReport` back from each sender).

Two levels, because the trainer is usually other processes:
- on each trainer rank, a bucket iterator `buckets(bucket_bytes) -> Iterable[list[(hf_name,
  tensor)]]` (`BucketFn`; the Megatron policy's `iter_hf_buckets`: a collective, senders yield,
  others yield nothing) and the rank-side entry point `mlrl.weight_sync.sender.push_from_rank`;
- in the driver, a `WeightSource`: `push(request)` makes every trainer rank run
  `push_from_rank(request, buckets, sender_index)` and returns the senders' reports; and
  `canary_logprobs` computes the trainer's logprobs of a fixed token sequence, to compare with
  the engines' after every sync.

Runs use `mlrl.trainer.driver.client.MegatronWeightSource`; tools/hf_weight_source.py implements
both levels in one process (tests, tools/bench_weight_sync.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Literal, Protocol, runtime_checkable

from mlrl.weight_sync.wire import NamedTensors

BucketFn = Callable[[int], Iterable[NamedTensors]]
"""bucket_bytes -> buckets of (HF name, full tensor); for PushRequest.content="adapters" the LoRA
adapters, peft-named."""


@dataclass
class PushRequest:
    """What the driver asks every trainer rank to do for one sync (JSON-serialisable)."""

    transport: str                        # a name in mlrl.weight_sync.registry.TRANSPORTS (weight_sync.transport)
    version: int
    bucket_bytes: int = 64 << 20
    verify: bool = True                   # compute per-tensor checksums
    group: dict[str, Any] | None = None   # broadcast: GroupSpec.to_json()
    disk_dir: str | None = None           # disk: folder of this version's shards
    phase: Literal["send", "release"] = "send"  # "release": free what a send kept alive (cuda_ipc, engines loaded)
    content: Literal["weights", "adapters"] = "weights"  # adapters: only the LoRA adapters (peft names)

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


@runtime_checkable
class WeightSource(Protocol):
    """Driver-side handle on the trainer's weights."""

    @property
    def num_senders(self) -> int:
        """K: ranks that send (one per pipeline stage); sender indices are 0..K-1."""
        ...

    def push(self, request: PushRequest) -> list[SendReport]:
        """Blocking: run `push_from_rank(request, ...)` on every trainer rank; the K senders' reports, by sender index.
        Called from a worker thread while the driver drives the engines; must not hold the event loop."""
        ...

    def canary_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """logprob (temperature 1) of each completion token given prompt + preceding completion tokens."""
        ...

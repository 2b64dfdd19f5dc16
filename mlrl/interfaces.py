"""The seams between mlrl's packages, as Protocols: what each side may ask of the other.

The loop (mlrl/loop.py, mlrl/update.py) holds its components through these types only, so a
component can be replaced (a LoRA policy, a critic, another rollout backend, an in-process test
double) without the loop branching on what it is. Each Protocol lists exactly the calls its
consumers make; keep each small (about six members at most).

    Policy       the trainer as the loop sees it (driver side: mlrl.trainer.driver.TrainerClient)
    Critic       the value model (mlrl.trainer.driver.CriticClient), PPO with GAE only
    RolloutPool  the engines as the runner and the weight sync see them (mlrl.rollout.EnginePool)
    EngineHandle one engine of the pool, with the control calls a weight sync makes on it
    WeightSync   trainer -> engines weight sync (mlrl.weight_sync.WeightSync)
    Checkpointer atomic training checkpoints and HF exports (mlrl.checkpoint.Checkpointer)
    RewardFn     scores one completion against its dataset row (mlrl.reward)
    Workflow     turns one dataset row into scored samples (mlrl.workflow.RolloutWorkflow)
    InferenceEngine what a workflow may call: one generation per request (GroupInferenceEngine: n)

The values that cross a seam are typed too: dataclasses where the driver builds them
(`RouterDiagnostics`, `PendingSave`), TypedDicts where they travel as plain dicts through a
pickle or a JSON file (`ResumeInfo`, `SavedLoopState`), `JSONObject` for vLLM's own HTTP payloads. The
one `Any` left is a dataset row's values (`mlrl.types.Row`): those are the user's own columns.

This module imports only the plain data types (mlrl.types, mlrl.experience.batch) so that every
package can depend on it and it depends on none of them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypedDict, Union, runtime_checkable

import numpy as np
import torch

from mlrl.experience.batch import MicroBatch
from mlrl.types import EpisodeOutput, ModelRequest, ModelResponse, Row, Sample

PerDP = list[list[MicroBatch]]
"""Packed micro-batches per data-parallel rank: [dp rank][micro-batch]."""

JSONValue = Union[str, int, float, bool, None, list["JSONValue"], dict[str, "JSONValue"]]
JSONObject = Mapping[str, JSONValue]
"""A JSON object as vLLM's HTTP API takes and returns it (weight-transfer init / update infos)."""

EnginePauseMode = Literal["abort", "wait", "keep"]
"""vLLM's pause modes: abort in-flight requests, wait for them, or keep them suspended."""


@dataclass
class RouterDiagnostics:
    """MoE router replay on the current weights (`Policy.router_diagnostics`)."""

    replay: list[list[torch.Tensor]]   # [dp][micro-batch] logprobs [S], the engines' routes replayed
    own: list[list[torch.Tensor]]      # the same with the trainer's own routing
    matches: int                       # token x MoE-layer top-k sets equal to the engine's, all ranks
    compared: int                      # token x MoE-layer sets compared


class ResumeInfo(TypedDict):
    """What loading a training checkpoint into the trainer did (`Policy.load_checkpoint`)."""

    optimizer_steps: int
    optimizer_loaded: bool
    rng_restored: bool
    saved_layout: dict[str, int]
    scheduler_overrides: dict[str, object]   # scheduler fields the config changed since the save


class SavedLoopState(TypedDict):
    """What a checkpoint records besides the trainer state (mlrl.loop.saved_loop_state), for resume."""

    weight_version: int
    sampler: dict[str, int]
    config: str                        # the run's resolved config, YAML
    in_flight_rows: list[Row]          # async: rows in flight at the save, re-issued first on resume


@dataclass
class PendingSave:
    """An async checkpoint whose shards are still being written (`Checkpointer.pending`)."""

    tmp: Path                          # its temporary folder, renamed on commit
    step: int
    loop_state: Mapping[str, object]   # a SavedLoopState (RL), or the SFT run's own


class Policy(Protocol):
    """What the loop asks of the policy trainer. Every call is one collective over all trainer
    ranks; micro-batches arrive per DP rank and results come back per DP rank."""

    dp_size: int

    def compute_logprobs(self, per_dp: PerDP, temperature: float, *,
                         reference: bool = False) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """[dp][micro-batch] -> (token logprobs [S], entropy [S]); `reference`: the frozen initial model."""
        ...

    def update(self, per_dp: PerDP) -> dict[str, float]:
        """One optimizer update on the micro-batches (advantages etc. attached); loss metrics."""
        ...

    def router_diagnostics(self, per_dp: PerDP, temperature: float) -> RouterDiagnostics:
        """MoE router replay: logprobs with and without the engines' routes, and the agreement counts."""
        ...

    def save_checkpoint(self, path: Path, critic_path: Path | None = None) -> None: ...

    def load_checkpoint(self, path: Path, critic_path: Path | None = None) -> ResumeInfo: ...

    def finalize_checkpoints(self, blocking: bool = True) -> int:
        """Finalize finished async saves; how many are still pending (0 = all done)."""
        ...

    def export_hf(self, out_dir: Path) -> None: ...


class Offloadable(Protocol):
    """A trainer that gives its device memory back between steps (colocated placement)."""

    def offload(self, kinds: list[str]) -> dict[str, float]:
        """Release `kinds` ("params", "grads", "optimizer"); bytes per kind, bytes copied, device
        bytes measured as freed ("measured": the CUDA allocator's count, 0 on CPU), seconds."""
        ...

    def reload(self, kinds: list[str] | None = None) -> dict[str, float]:
        """What was offloaded (`kinds`: only those) back on the device, unchanged (gradients zeroed)."""
        ...


class Critic(Protocol):
    """What the loop asks of the value model (PPO with GAE)."""

    dp_size: int

    def compute_values(self, per_dp: PerDP) -> list[list[torch.Tensor]]:
        """[dp][micro-batch] -> values [S], token-aligned like logprobs."""
        ...

    def update(self, per_dp: PerDP) -> dict[str, float]:
        """One critic update on the micro-batches (old_values / returns attached)."""
        ...


class EngineControl(Protocol):
    """The control calls a weight sync makes on one engine (mlrl.rollout.client.EngineClient)."""

    async def pause(self, mode: EnginePauseMode = "wait", *, timeout: float | None = None) -> None: ...

    async def resume(self) -> None: ...

    async def reset_prefix_cache(self) -> bool: ...

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]: ...

    async def init_weight_transfer(self, init_info: JSONObject, *, timeout: float | None = None) -> None: ...

    async def shutdown_weight_transfer(self) -> None: ...

    async def start_weight_update(self) -> None: ...

    async def update_weights(self, update_info: JSONObject, *, timeout: float | None = None) -> None: ...

    async def finish_weight_update(self, version: int, *, timeout: float | None = None) -> None: ...

    async def collective_rpc(self, method: str, *, args: list[str] | None = None,
                             kwargs: dict[str, str] | None = None, timeout: float | None = None) -> list[JSONValue]:
        """One result per worker of the engine."""
        ...

    async def sleep(self, level: int = 1, mode: EnginePauseMode = "wait") -> None: ...

    async def wake_up(self, tags: Sequence[str] | None = None) -> bool: ...

    async def is_sleeping(self) -> bool: ...


class EngineHandle(Protocol):
    """One engine as the weight sync sees it."""

    index: int
    incarnation: int           # +1 per (re)start: a weight-transfer group must be rebuilt when it changes

    @property
    def name(self) -> str: ...

    @property
    def client(self) -> EngineControl | None: ...


@runtime_checkable
class InferenceEngine(Protocol):
    """What a workflow may call: one generation per request, token ids in and out."""

    async def agenerate(self, req: ModelRequest) -> ModelResponse: ...


@runtime_checkable
class GroupInferenceEngine(InferenceEngine, Protocol):
    """An engine that also samples a whole group of one prompt in one request."""

    async def agenerate_group(self, req: ModelRequest) -> list[ModelResponse]:
        """`req.gconfig.n_samples` responses to `req.input_ids`."""
        ...


class RolloutPool(GroupInferenceEngine, Protocol):
    """The engines as the episode runner (agenerate, agenerate_group) and the weight sync (pause /
    transfer / commit / resume) see them."""

    @property
    def version(self) -> int:
        """Weight version every live engine holds."""
        ...

    def live_engines(self) -> Sequence[EngineHandle]: ...

    @property
    def paused(self) -> bool:
        """Routing is stopped (`pause` returned and `resume` has not been called since)."""
        ...

    async def pause(self) -> None:
        """Stop routing; in-flight requests finish or are interrupted (rollout.interrupt_on_sync)."""
        ...

    def commit_version(self, version: int, engines: Sequence[EngineHandle], *, pushed: bool = True,
                       incarnations: dict[int, int] | None = None) -> None: ...

    async def resume(self) -> None: ...

    async def fetch_routing(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray | None]:
        """MoE router replay: the experts the engines routed each token sequence through
        ([m, layers, top_k] arrays, None where unknown)."""
        ...


class SyncHooks(Protocol):
    """Calls a weight sync makes around each attempt's transfer (colocated placement: mlrl.colocation)."""

    async def before_transfer(self) -> None:
        """The engines' weights must be resident and the trainer's parameters on its devices."""
        ...

    async def before_verify(self) -> None:
        """The transfer is done: the trainer's parameters may leave; the engines need their KV cache back."""
        ...


class WeightSync(Protocol):
    """Trainer -> engines: one verified weight sync per call (transport chosen by config)."""

    async def sync(self, version: int, hooks: SyncHooks | None = None) -> Mapping[str, float]:
        """Bring every live engine to the trainer's current weights, tagged `version`; metrics."""
        ...

    async def close(self) -> None: ...


class Checkpointer(Protocol):
    """Training checkpoints (trainer state + loop state, committed atomically) and HF exports."""

    last_saved: Path | None
    last_export: Path | None
    pending: PendingSave | None  # an async save written but not yet committed (None: `finalize` has nothing to do)

    def save(self, step: int, loop_state: Mapping[str, object]) -> Path | None:
        """The committed checkpoint, or None while an async save is still being written."""
        ...

    def finalize(self, blocking: bool = True) -> Path | None:
        """Commit a pending async save once it is complete on every rank (`blocking`: wait)."""
        ...

    def export_hf(self, step: int) -> Path: ...


class RewardFn(Protocol):
    """Scores one completion (AReaL's signature, mlrl.reward.registry): the row's columns come as
    keyword arguments, of which a function takes the ones it needs (so it has `**kwargs`).
    Sync or async."""

    def __call__(self, prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], /,
                 **data: Any) -> float | Awaitable[float]: ...


EpisodeResult = Union[EpisodeOutput, Sample, Sequence[Sample], Mapping[str, object], None]
"""What `Workflow.arun_episode` may return (mlrl.workflow.samples.to_samples): an EpisodeOutput,
Sample(s), an AReaL dict of tensors or of interactions, or None (the episode is rejected)."""


class Workflow(Protocol):
    """Turns one dataset row into scored, trainable samples (mlrl.workflow.api.RolloutWorkflow)."""

    async def arun_episode(self, engine: InferenceEngine, data: Row) -> EpisodeResult:
        """None (rejected), Sample(s), AReaL dicts, interactions or an EpisodeOutput."""
        ...

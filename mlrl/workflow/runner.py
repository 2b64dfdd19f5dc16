"""The episode runner: turns the prompts of one RL step into GRPO groups of trainable samples.

`run_batch(rows, n)` runs n episodes per row (one workflow instance serves them all), at most
`max_concurrency` episodes at a time, each under `episode_timeout_s`, and returns one
`GroupResult` per row, in row order. Nothing an episode does stops the batch:
- the workflow returns None (or no samples)       -> REJECTED, counted;
- the per-episode timeout fires                    -> TIMEOUT, counted, the run continues;
- the workflow raises, or an engine request fails -> ERROR, with message, type and traceback in
  `EpisodeResult.info["error"]` (rLLM's layout);
- reward-function failures / timeouts inside the episode are counted per episode.
Only COMPLETED episodes contribute samples; every sample of a group carries the group's id
(an adapter may add a suffix, e.g. rLLM's trajectory name, so that different roles form
different groups). `summarize(groups)` gives the step's rollout metrics.

Each episode gets a deep copy of its row (workflows may append to `messages`) and a thin wrapper
around the engine that records every response, so truncation and engine failures are seen for
any workflow type.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import json
import logging
import math
import time
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlrl.metrics.pass_at_k import by_source
from mlrl.metrics.timer import ACTIVITY
from mlrl.reward import RewardStats, collect_reward_stats
from mlrl.types import ModelResponse, Sample, SampleStatus, StopReason, TerminationReason
from mlrl.workflow.api import EVALUATION, EpisodeOutput, EpisodeStatus
from mlrl.workflow.samples import to_samples

logger = logging.getLogger(__name__)


@dataclass
class EpisodeResult:
    """One episode as the runner recorded it."""

    status: EpisodeStatus
    samples: list[Sample] = field(default_factory=list)
    termination_reason: TerminationReason | None = None
    is_correct: bool | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    reward_stats: RewardStats = field(default_factory=RewardStats)
    duration_s: float = 0.0
    index: int = 0

    @property
    def reward(self) -> float | None:
        return sum(s.reward for s in self.samples) / len(self.samples) if self.samples else None

    @property
    def correct(self) -> bool:
        if self.is_correct is not None:
            return bool(self.is_correct)
        return any(s.task_reward > 0 for s in self.samples)


@dataclass
class GroupResult:
    """The n episodes of one prompt."""

    group_id: str
    data: dict[str, Any]
    episodes: list[EpisodeResult]

    @property
    def samples(self) -> list[Sample]:
        return [s for e in self.episodes if e.status == EpisodeStatus.COMPLETED for s in e.samples]

    @property
    def rewards(self) -> list[float]:
        return [s.task_reward for s in self.samples]

    def count(self, status: EpisodeStatus) -> int:
        return sum(e.status == status for e in self.episodes)

    @property
    def metrics(self) -> dict[str, float]:
        return summarize([self])


class BatchResult(list):
    """The groups of one `run_batch` call (a list of GroupResult, in row order), with all their
    trainable samples and the step's rollout metrics."""

    def __init__(self, groups: Sequence[GroupResult], metrics: dict[str, float]):
        super().__init__(groups)
        self.metrics = metrics

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self for s in g.samples]


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed that is a pure function of `parts` (their JSON form): the same episode of the
    same step gets the same seed in every run, whatever the batching or timing."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "big") >> 1


class _RecordingEngine:
    """Passes everything through to the engine and remembers the responses of one episode.

    With `seed` (rollout.sampling.seed), the k-th request the episode starts is sent with the
    per-request seed derive_seed(seed, k): vLLM then samples it with its own RNG, so its tokens
    do not depend on which other requests shared the batch (reproducible runs)."""

    def __init__(self, engine: Any, seed: int | None = None):
        self._engine = engine
        self._seed = seed
        self._calls = 0
        self.responses: list[ModelResponse] = []

    def _seeded(self, req: Any) -> Any:
        """`req` with the next call's seed (counted when the call starts, so concurrent calls of
        one episode get distinct seeds in the order they were made)."""
        k, self._calls = self._calls, self._calls + 1
        if self._seed is None:
            return req
        return dataclasses.replace(req, gconfig=req.gconfig.new(seed=derive_seed(self._seed, k)))

    async def agenerate(self, req: Any) -> ModelResponse:
        req = self._seeded(req)
        with ACTIVITY.busy("generate"):
            resp = await self._engine.agenerate(req)
        self.responses.append(resp)
        return resp

    async def agenerate_group(self, req: Any) -> list[ModelResponse]:
        """n = req.gconfig.n_samples samples in one engine request when the engine can (the pool:
        one seed for the group, vLLM gives sample i seed + i), else n single requests."""
        n = req.gconfig.n_samples
        if not hasattr(self._engine, "agenerate_group"):
            one = req.gconfig.new(n_samples=1)
            singles = [dataclasses.replace(req, gconfig=one, rid=f"{req.rid}:{i}") for i in range(n)]
            return list(await asyncio.gather(*(self.agenerate(r) for r in singles)))
        req = self._seeded(req)
        with ACTIVITY.busy("generate"):
            resps = await self._engine.agenerate_group(req)
        self.responses.extend(resps)
        return resps

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class EpisodeRunner:
    """Runs episodes of `workflow` (anything with `arun_episode(engine, data)`) against `engine`."""

    def __init__(
        self,
        workflow: Any,
        engine: Any,
        *,
        max_concurrency: int = 64,
        episode_timeout_s: float = 300.0,
        metric_prefix: str = "",
        max_logged_errors: int = 5,
        seed: int | None = None,
    ):
        if not hasattr(workflow, "arun_episode"):
            raise TypeError(
                f"EpisodeRunner: {type(workflow).__name__} has no arun_episode (build it with "
                "mlrl.workflow.build_workflow)"
            )
        if max_concurrency < 1:
            raise ValueError(f"EpisodeRunner: max_concurrency must be >= 1, got {max_concurrency}")
        self.workflow = workflow
        self.engine = engine
        self.max_concurrency = max_concurrency
        self.episode_timeout_s = episode_timeout_s
        self.metric_prefix = metric_prefix
        self.seed = seed  # per-request seeds from (seed, weight version, group slot, episode index); None = off
        self._slots: dict[tuple[int, bool], int] = {}
        self._sem = asyncio.Semaphore(max_concurrency)
        self._errors_logged = 0
        self._max_logged_errors = max_logged_errors
        self.last_metrics: dict[str, float] = {}

    @classmethod
    def from_config(cls, cfg: Any, workflow: Any, engine: Any, **kw: Any) -> "EpisodeRunner":
        """From `mlrl.config.schema.WorkflowConfig` (max_concurrency, episode_timeout_s); `seed`
        (rollout.sampling.seed) may come in `kw`."""
        return cls(workflow, engine, max_concurrency=cfg.max_concurrency, episode_timeout_s=cfg.episode_timeout_s, **kw)

    # --- public API ----------------------------------------------------------------------------
    async def run_batch(self, rows: Sequence[dict[str, Any]], n: int, *, evaluation: bool = False) -> BatchResult:
        """n episodes per row; one GroupResult per row, in order (`.samples`, `.metrics`).
        `evaluation=True` runs the episodes with `is_evaluation()` true (workflows may then use
        their evaluation sampling) and leaves `last_metrics` alone."""
        groups = await asyncio.gather(*(self.run_group(row, n, evaluation=evaluation) for row in rows))
        metrics = summarize(groups, self.metric_prefix)
        if not evaluation:
            self.last_metrics = metrics
        return BatchResult(groups, metrics)

    async def run_group(self, data: dict[str, Any], n: int, *, group_id: str | None = None,
                        evaluation: bool = False) -> GroupResult:
        """n episodes of one prompt (the GRPO group)."""
        if n < 1:
            raise ValueError(f"run_group: n must be >= 1, got {n}")
        slot = self._next_slot(evaluation)  # before any await: groups take slots in the order they start
        token = EVALUATION.set(evaluation)
        try:
            return await self._run_group(data, n, group_id, slot)
        finally:
            EVALUATION.reset(token)

    def _next_slot(self, evaluation: bool) -> tuple[int, bool, int]:
        """(weight version, evaluation, k): this is the k-th group started at that version (counted
        apart for evaluation). Seeds derive from it, so two groups of the same prompt in one step
        (duplicate rows) sample differently, and a resumed run, which restarts at a version
        boundary, gets the seeds the uninterrupted run had."""
        v = int(getattr(self.engine, "version", 0))
        key = (v, evaluation)
        k = self._slots.get(key, 0)
        self._slots = {kk: kv for kk, kv in self._slots.items() if kk[0] >= v - 1}  # older versions are done
        self._slots[key] = k + 1
        return v, evaluation, k

    async def _run_group(self, data: dict[str, Any], n: int, group_id: str | None,
                         slot: tuple[int, bool, int]) -> GroupResult:
        gid = group_id or uuid.uuid4().hex[:16]
        if getattr(self.workflow, "group_native", False):
            episodes = await self._run(data, gid, 0, n, group_call=True, slot=slot)
        else:
            parts = await asyncio.gather(*(self._run(data, gid, i, 1, slot=slot) for i in range(n)))
            episodes = [e for part in parts for e in part]
        for i, e in enumerate(episodes):
            e.index = i
            for s in e.samples:
                suffix = s.metadata.pop("group_suffix", None)
                s.group_id = f"{gid}:{suffix}" if suffix else gid
                s.metadata.setdefault("episode", f"{gid}/{i}")
        return GroupResult(group_id=gid, data=data, episodes=episodes)

    async def run_episode(self, data: dict[str, Any]) -> EpisodeResult:
        """One episode outside any group (evaluation, debugging)."""
        return (await self.run_group(data, 1)).episodes[0]

    async def aclose(self) -> None:
        close = getattr(self.workflow, "aclose", None)
        if close is not None:
            await close()

    # --- internals -----------------------------------------------------------------------------
    async def _run(
        self, data: dict[str, Any], gid: str, index: int, n: int, group_call: bool = False,
        slot: tuple[int, bool, int] = (0, False, 0),
    ) -> list[EpisodeResult]:
        """One workflow call: one episode, or the n episodes of a `group_native` workflow's arun_group."""
        async with self._sem:
            seed = None
            if self.seed is not None:
                seed = derive_seed(self.seed, *slot, index)
            engine = _RecordingEngine(self.engine, seed)
            t0 = time.monotonic()
            row = copy.deepcopy(data)
            with collect_reward_stats() as stats:
                try:
                    if group_call:
                        coro = self.workflow.arun_group(engine, row, n)
                    else:
                        coro = self.workflow.arun_episode(engine, row)
                    if self.episode_timeout_s and self.episode_timeout_s > 0:
                        async with asyncio.timeout(self.episode_timeout_s):
                            try:
                                result = await coro
                            except TimeoutError:  # raised by the workflow itself; ours surfaces at exit of the block
                                raise _InnerTimeout(traceback.format_exc()) from None
                    else:
                        result = await coro
                except TimeoutError:
                    results = [
                        EpisodeResult(
                            EpisodeStatus.TIMEOUT,
                            termination_reason=TerminationReason.TIMEOUT,
                            info={"timeout_s": self.episode_timeout_s},
                        )
                        for _ in range(n)
                    ]
                except _InnerTimeout as e:
                    results = [
                        self._error_result("TimeoutError", "a timeout inside the workflow", e.tb) for _ in range(n)
                    ]
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    results = [self._error_result(type(e).__name__, str(e), traceback.format_exc()) for _ in range(n)]
                else:
                    grouped = (
                        group_call and isinstance(result, list) and all(isinstance(r, EpisodeOutput) for r in result)
                    )
                    outputs = result if grouped else [result]
                    try:  # a malformed result (a dict without rewards, logprobs of another length) is the
                        results = [self._convert(o, engine.responses) for o in outputs]  # workflow's failure
                    except Exception as e:
                        results = [self._error_result(type(e).__name__, str(e), traceback.format_exc())
                                   for _ in range(n)]
            dt = time.monotonic() - t0
            for r in results:
                r.duration_s = dt
                r.reward_stats = stats
                if r.status == EpisodeStatus.ERROR:
                    self._log_error(gid, index, r.info.get("error", {}))
            return results

    def _error_result(self, etype: str, message: str, tb: str) -> EpisodeResult:
        return EpisodeResult(EpisodeStatus.ERROR, termination_reason=TerminationReason.ERROR,
                             info={"error": {"error_message": message, "error_type": etype, "traceback": tb}})

    def _convert(self, result: Any, responses: list[ModelResponse]) -> EpisodeResult:
        out = self._convert_result(result, responses)
        bad = next((s.reward for s in out.samples if not math.isfinite(float(s.reward))), None)
        if bad is not None:  # a NaN would make the whole group's advantages NaN: this episode fails instead
            return self._error_result("WorkflowResultError", f"the workflow returned a non-finite reward ({bad})", "")
        return out

    def _convert_result(self, result: Any, responses: list[ModelResponse]) -> EpisodeResult:
        if isinstance(result, EpisodeOutput):
            status = result.status
            samples = list(result.samples) if status == EpisodeStatus.COMPLETED else []
            if status == EpisodeStatus.COMPLETED and not samples:
                status = EpisodeStatus.REJECTED
            return EpisodeResult(
                status, samples, result.termination_reason, result.is_correct, dict(result.metrics), dict(result.info)
            )
        failed = [r for r in responses if r.stop_reason.unfinished]
        if failed:
            msg = f"engine request {failed[0].rid} ended with {failed[0].stop_reason.value}: {failed[0].error}"
            return self._error_result("EngineError", msg, "")
        samples = to_samples(result)
        _mark_truncated(samples, responses)
        if not samples:
            return EpisodeResult(EpisodeStatus.REJECTED)
        return EpisodeResult(EpisodeStatus.COMPLETED, samples)

    def _log_error(self, gid: str, index: int, err: dict[str, Any]) -> None:
        if self._errors_logged < self._max_logged_errors:
            self._errors_logged += 1
            logger.warning(
                "episode %s/%d failed: %s: %s\n%s",
                gid,
                index,
                err.get("error_type"),
                err.get("error_message"),
                err.get("traceback", ""),
            )


class _InnerTimeout(Exception):
    """A TimeoutError raised by the workflow itself (not our per-episode timeout)."""

    def __init__(self, tb: str):
        super().__init__("timeout inside the workflow")
        self.tb = tb


def _mark_truncated(samples: list[Sample], responses: list[ModelResponse]) -> None:
    cut = [r.output_tokens for r in responses if r.stop_reason == StopReason.LENGTH and r.output_tokens]
    for s in samples:
        if s.status == SampleStatus.COMPLETED and any(
            len(o) <= len(s.tokens) and s.tokens[-len(o) :] == list(o) for o in cut
        ):
            s.status = SampleStatus.TRUNCATED


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def summarize(groups: Sequence[GroupResult], prefix: str = "") -> dict[str, float]:
    """Rollout metrics of one step: episode outcomes, reward, accuracy, reward-function failures,
    response lengths, truncation, episode time, groups without reward variance, and the mean of
    every metric the workflow reported (`workflow/<name>`). Keys get `<prefix>/` when a prefix is given."""
    episodes = [e for g in groups for e in g.episodes]
    done = [e for e in episodes if e.status == EpisodeStatus.COMPLETED]
    samples = [s for g in groups for s in g.samples]
    count = {st: sum(e.status == st for e in episodes) for st in EpisodeStatus}
    rs = RewardStats()
    for st in {id(e.reward_stats): e.reward_stats for e in episodes}.values():
        rs.add(st)
    m: dict[str, float] = {
        "groups/count": float(len(groups)),
        "groups/samples": float(len(samples)),
        "episodes/total": float(len(episodes)),
        "episodes/completed": float(count[EpisodeStatus.COMPLETED]),
        "episodes/rejected": float(count[EpisodeStatus.REJECTED]),
        "episodes/timeout": float(count[EpisodeStatus.TIMEOUT]),
        "episodes/error": float(count[EpisodeStatus.ERROR]),
        "episodes/failures": float(count[EpisodeStatus.TIMEOUT] + count[EpisodeStatus.ERROR]),
        "reward_fn/calls": float(rs.calls),
        "reward_fn/failures": float(rs.failures),
        "reward_fn/timeouts": float(rs.timeouts),
    }
    if samples:
        rewards = [s.task_reward for s in samples]  # before any overlong shaping, whenever summarised
        mu = _mean(rewards)
        m["reward/mean"] = mu
        m["reward/std"] = math.sqrt(_mean([(r - mu) ** 2 for r in rewards]))
        m["response/tokens_mean"] = _mean([float(s.num_loss_tokens) for s in samples])
        m["response/truncated_frac"] = _mean([float(s.status == SampleStatus.TRUNCATED) for s in samples])
    if done:
        m["reward/accuracy"] = _mean([float(e.correct) for e in done])
    if episodes:
        m["episodes/time_mean"] = _mean([e.duration_s for e in episodes])
        m["episodes/time_max"] = max(e.duration_s for e in episodes)
    multi = [g for g in groups if len(g.samples) >= 2]
    if multi:
        m["groups/zero_std_frac"] = _mean([float(len(set(g.rewards)) == 1) for g in multi])
    for k in sorted({k for e in done for k in e.metrics}):
        m[f"workflow/{k}"] = _mean([float(e.metrics[k]) for e in done if k in e.metrics])
    for source, gs in by_source(groups).items():  # a data.mix source (or a dataset's own data_source column)
        m[f"source/{source}/groups"] = float(len(gs))
        if rs_ := [s.task_reward for g in gs for s in g.samples]:
            m[f"source/{source}/reward/mean"] = _mean(rs_)
        if ok := [float(e.correct) for g in gs for e in g.episodes if e.status == EpisodeStatus.COMPLETED]:
            m[f"source/{source}/reward/accuracy"] = _mean(ok)
    return {f"{prefix}/{k}" if prefix else k: v for k, v in m.items()}

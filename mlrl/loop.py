"""The RL loop, in straight-line calls (read this file first).

One step:  prompts -> episodes (engines + workflow + reward) -> trainable samples (DAPO
filtering refills the batch) -> the train phase: trainer logprobs (old, reference) / critic values
-> advantages -> the step's optimizer updates (mlrl/update.py) -> weight sync to the engines
(versioned, verified) -> metrics -> checkpoint / export when due (mlrl/checkpoint/schedule.py).
With cluster.placement=colocated (sync mode only), the engines sleep while the trainer steps and
the trainer offloads while they generate (mlrl/colocation.py).

Two modes:
- sync (`train_sync`, here): on-policy; generation and training alternate; every sample of step k
  was produced by weight version k-1.
- async (`train_async`, mlrl/loop_async.py): a producer keeps `staleness` (eta) steps of
  generation in flight while the trainer trains; it reuses this file's step parts.

A run's fixed parts come ready-made in `RunContext` (built and torn down by mlrl/jobs/rl.py); what
the loop changes as it goes is its small `LoopState`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mlrl.algorithms.sampling import apply_overlong_shaping, filter_groups
from mlrl.checkpoint.schedule import SaveSchedule
from mlrl.colocation import Colocation
from mlrl.config import Config, dump_yaml
from mlrl.data.sampler import PromptSampler
from mlrl.interfaces import Checkpointer, Critic, Policy, RolloutPool, SavedLoopState, WeightSync
from mlrl.metrics import MetricsLogger, StepTimer
from mlrl.metrics.pass_at_k import pass_metrics
from mlrl.reward.model import active_judge
from mlrl.types import Row, Sample, SampleStatus
from mlrl.update import train_on
from mlrl.workflow.failures import FailureGuard
from mlrl.workflow.runner import EpisodeRunner, GroupResult, summarize

log = logging.getLogger(__name__)


class Progress(Protocol):
    """A progress bar (tqdm's interface)."""

    def update(self, n: int = 1) -> object: ...
    def set_postfix(self, **kwargs: str) -> None: ...
    def close(self) -> None: ...


@dataclass
class LoopState:
    """What the loop changes as it runs (the rest of a checkpoint's loop record is the sampler's position)."""

    start_step: int = 0          # last completed step when the loop started (0 = fresh run)
    version: int = 0             # weight version the engines hold
    history: list[dict[str, float]] = field(default_factory=list)  # every step's metrics line
    step_end: float | None = None  # perf_counter() when the previous step ended (its metrics line written)
    in_flight: dict[int, Row] = field(default_factory=dict)  # async: rows started, not yet trained on
    resume_rows: list[Row] = field(default_factory=list)     # rows in flight when the resumed checkpoint was saved


@dataclass
class RunContext:
    """The fixed parts of a run (each typed by the interface the loop uses) and its `LoopState`."""

    cfg: Config
    policy: Policy               # the trainer ranks (mlrl.trainer.driver.TrainerClient)
    engines: RolloutPool         # mlrl.rollout.pool.EnginePool
    weight_sync: WeightSync      # transport chosen by config (mlrl.weight_sync)
    runner: EpisodeRunner        # episodes of a step: workflow + reward, groups, failures
    sampler: PromptSampler
    logger: MetricsLogger
    checkpoint: Checkpointer     # mlrl.checkpoint.Checkpointer (save / commit / export)
    saves: SaveSchedule | None   # when checkpoints / exports are due (None: never, e.g. a unit test's loop)
    critic: Critic | None = None  # the value model (algorithm.advantage=gae), else None
    eval_rows: list[Row] | None = None
    progress: Progress | None = None
    colocation: Colocation | None = None  # cluster.placement=colocated: engines sleep while the trainer steps
    failures: FailureGuard | None = None  # stops the run when a step's episodes fail (made on first use)
    eval_answers: Callable[[int, Sequence[GroupResult]], None] | None = None  # eval.save_answers: writes a step's
    #                                                                           held-out answers
    state: LoopState = field(default_factory=LoopState)
    # held through each train phase and its weight sync: a restarted engine's refresh waits (guarded_refresh)
    trainer_busy: asyncio.Lock = field(default_factory=asyncio.Lock)

    def check_failures(self, step: int, groups: Sequence[GroupResult]) -> None:
        """Raise EpisodeFailures before anything trains on a step whose episodes failed
        (workflow.max_failure_fraction / max_failure_steps; mlrl.workflow.failures)."""
        if self.failures is None:
            w = self.cfg.workflow
            self.failures = FailureGuard(w.max_failure_fraction, w.max_failure_steps)
        self.failures.observe(step, groups)

    def step_timer(self) -> StepTimer:
        """The next step's timer: it starts where the previous step ended, and carries the
        previous step's checkpoint time (saved after its metrics line) as timing/checkpoint."""
        timer = StepTimer(start=self.state.step_end)
        seconds = self.saves.take_seconds() if self.saves is not None else 0.0
        if seconds:
            timer.add("checkpoint", seconds)
        return timer


async def train_sync(ctx: RunContext) -> None:
    cfg = ctx.cfg
    for step in range(ctx.state.start_step + 1, cfg.trainer.total_steps + 1):
        timer = ctx.step_timer()
        with timer("rollout"):
            samples, rollout_metrics = await rollout_sync(ctx, step)
        if ctx.colocation is not None:  # engines sleep, the trainer's state comes back
            await ctx.colocation.to_trainer(timer)
            if ctx.saves is not None:
                await ctx.saves.run_deferred(timer)
        async with ctx.trainer_busy:  # through the sync: see guarded_refresh
            if ctx.colocation is not None:
                metrics = await train_phase_in_thread(ctx, samples, timer, step)
            else:  # the idle engines pause while the trainer trains: the weight sync finds them paused
                metrics, _ = await asyncio.gather(train_phase_in_thread(ctx, samples, timer, step),
                                                  ctx.engines.pause())
            sync_metrics = await sync_weights(ctx, step, timer)
        eval_metrics = await evaluate_if_due(ctx, step, timer)
        timing = timer.finish(details=sync_timing(sync_metrics) | train_timing(metrics))
        finish_step(ctx, step, {**rollout_metrics, **metrics, **sync_metrics, **eval_metrics, **timing})
        await save_if_due(ctx, step)


async def sync_weights(ctx: RunContext, step: int, timer: StepTimer) -> Mapping[str, float]:
    """The engines get the weights of `step` (colocated: the trainer offloads and the engines wake around it)."""
    ctx.state.version = step
    if ctx.colocation is not None:
        return await ctx.colocation.sync(ctx.weight_sync, step, timer)
    with timer("sync"):
        return await ctx.weight_sync.sync(step)


def sync_timing(sync_metrics: Mapping[str, float]) -> dict[str, float]:
    """The weight sync's own phases, as sub-keys of timing/sync."""
    return {f"sync/{name}": float(sync_metrics[f"weight_sync/{key}"]) for name, key in (
        ("pause", "pause_s"), ("transfer", "transfer_s"), ("apply", "engine_apply_s"), ("verify", "verify_s"))
        if f"weight_sync/{key}" in sync_metrics}


def train_timing(metrics: Mapping[str, float]) -> dict[str, float]:
    """timing/train split: forward + backward and optimizer as measured on the trainer ranks (summed
    over the step's updates), the rest on the driver (packing, RPC, pickling) left to timing/train/driver
    by `StepTimer.finish`'s caller."""
    out = {}
    for name in ("forward_backward", "optimizer"):
        parts = [metrics[k] for k in (f"train/{name}_s", f"critic/{name}_s") if k in metrics]
        if parts:
            out[f"train/{name}"] = float(sum(parts))
    return out


# --------------------------------------------------------------------------- the steps' parts


async def rollout_sync(ctx: RunContext, step: int = 0) -> tuple[list[Sample], dict[str, float]]:
    """Generate prompts_per_step groups; with DAPO dynamic sampling, generate the missing groups
    again (up to max_rounds rounds) until that many informative groups are kept."""
    cfg, ds = ctx.cfg, ctx.cfg.algorithm.dynamic_sampling
    want = cfg.trainer.prompts_per_step
    sel, groups, rounds = Selection(ctx), [], 0
    while True:
        rows = next_rows(ctx, want - sel.groups_kept)
        batch = await ctx.runner.run_batch(rows, cfg.trainer.samples_per_prompt)
        rounds += 1
        groups += batch
        for g in batch:
            sel.routing_missing += await attach_routing(ctx, g.samples)
            sel.add(g.samples)
        if not ds.enabled or sel.groups_kept >= want or rounds >= ds.max_rounds:
            break
    ctx.check_failures(step, groups)
    # one round: the batch's own summary is already these groups' (run_batch computed it)
    summary = batch.metrics if rounds == 1 else summarize(groups, ctx.runner.metric_prefix)
    return sel.samples, {**summary, **sel.metrics(rounds)}


def next_rows(ctx: RunContext, n: int) -> list[Row]:
    """The next n prompts: first the rows that were in flight when the resumed checkpoint was saved
    (an asynchronous run's; its sampler position was saved after them), then the sampler's. A
    synchronous run that resumes an asynchronous run's checkpoint so skips no prompt."""
    resumed = ctx.state.resume_rows[:n]
    del ctx.state.resume_rows[:n]
    return resumed + (ctx.sampler.next_batch(n - len(resumed)) if n > len(resumed) else [])


class Selection:
    """The trainable samples of one step, taken group by group: failed / empty samples out, DAPO
    overlong shaping applied once, and with dynamic sampling a group whose rewards are all equal
    dropped (it has no group-relative signal)."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.samples: list[Sample] = []
        self.total = self.groups_seen = self.groups_kept = self.dropped = self.overlong = self.sub_dropped = 0
        self.routing_missing = 0

    def add(self, group_samples: list[Sample]) -> bool:
        """Take one group's samples; False when the group adds nothing to train on."""
        a, s = self.ctx.cfg.algorithm, self.ctx.cfg.rollout.sampling
        self.groups_seen += 1
        self.total += len(group_samples)
        keep = [x for x in group_samples if x.num_loss_tokens > 0 and x.status != SampleStatus.FAILED]
        if a.overlong_buffer:
            self.overlong += apply_overlong_shaping(keep, s.max_new_tokens, a.overlong_buffer, a.overlong_penalty)
        if a.dynamic_sampling.enabled:
            keep, dropped = filter_groups(keep)
            self.sub_dropped += dropped
        if not keep:
            self.dropped += 1
            return False
        self.samples += keep
        self.groups_kept += 1
        return True

    def metrics(self, rounds: float) -> dict[str, float]:
        m = {"samples/trainable": float(len(self.samples)), "samples/total": float(self.total)}
        versions = [v for x in self.samples if (v := x.oldest_version) >= 0]  # (unknown: not "version + 1")
        if versions:
            m["samples/staleness_max"] = float(self.ctx.state.version - min(versions))
        if self.ctx.cfg.algorithm.overlong_buffer:
            m["samples/overlong_penalised"] = float(self.overlong)
        if self.ctx.cfg.algorithm.router_replay:
            m["samples/routing_missing"] = float(self.routing_missing)
        if self.ctx.cfg.algorithm.dynamic_sampling.enabled:
            m["samples/groups_dropped_equal_reward"] = float(self.sub_dropped)
            m["rollout/filtered_fraction"] = self.dropped / max(1, self.groups_seen)
            m["rollout/sampling_rounds"] = float(rounds)
        return m


async def attach_routing(ctx: RunContext, samples: list[Sample]) -> int:
    """MoE router replay: each trainable sample gets the experts its engine routed it through
    (Sample.routed_experts). A sample whose rows are gone (its engine died, or the rows were
    evicted) cannot be replayed faithfully: it is marked failed, with the reason, and left out of
    training. Returns how many."""
    if not ctx.cfg.algorithm.router_replay:
        return 0
    todo = [s for s in samples if s.num_loss_tokens > 0 and s.status != SampleStatus.FAILED]
    if not todo:
        return 0
    rows = await ctx.engines.fetch_routing([s.tokens for s in todo])
    missing = 0
    for s, r in zip(todo, rows):
        # the prediction of token t is made at position t-1: rows are needed up to the last policy token - 1
        need = max(i for i, m in enumerate(s.loss_mask) if m)
        if r is None or len(r) < need:
            s.status = SampleStatus.FAILED
            s.metadata["error"] = (f"router replay: the engine's routed experts for this sample are unavailable "
                                   f"({'none' if r is None else f'{len(r)} of {need} positions'})")
            missing += 1
        else:
            s.routed_experts = r
    if missing:
        log.warning("router replay: %d of %d samples have no routed experts; left out of training", missing, len(todo))
    return missing


async def train_phase_in_thread(ctx: RunContext, samples: list[Sample], timer: StepTimer,
                                step: int) -> dict[str, float]:
    """train_phase in a worker thread; the caller holds ctx.trainer_busy through the step's weight
    sync (see guarded_refresh)."""
    return await asyncio.to_thread(train_phase, ctx, samples, timer, step)


def guarded_refresh(busy: asyncio.Lock, refresh: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """The pool's refresher (an engine restarted after a crash gets the current weights), run outside
    a step's train phase and weight sync (the loops hold `busy` through both): in the middle of the
    phase the trainer's weights are part-way through a step's updates, and between the phase and
    the sync they are the next version's; either would reach the engines labelled with the pool's
    current version, which they are not."""
    async def guarded() -> None:
        async with busy:
            await refresh()

    return guarded


def train_phase(ctx: RunContext, samples: list[Sample], timer: StepTimer, step: int) -> dict[str, float]:
    """The step's train phase (blocking trainer calls, run in a thread): behaviour / reference
    logprobs and critic values, advantages, then the step's optimizer updates (mlrl/update.py). A
    step left with nothing to train on (every episode failed, or dynamic sampling kept no group
    within its rounds) makes no update and says so."""
    if not samples:
        log.warning("step %d: no trainable samples (every episode failed, had no policy tokens or was filtered): "
                    "no update this step", step)
        return {"train/updates": 0.0}
    return train_on(ctx.cfg, ctx.policy, ctx.critic, samples, timer, step)


async def evaluate_if_due(ctx: RunContext, step: int, timer: StepTimer) -> dict[str, float]:
    """Held-out evaluation every data.eval_every steps and at the end: eval/* rollout metrics,
    eval/mean_reward, and eval/pass@1, eval/pass@k over eval.samples_per_prompt samples per prompt;
    with eval.save_answers, its answers go to `ctx.eval_answers`."""
    cfg = ctx.cfg
    if ctx.eval_rows and cfg.data.eval_every and (step % cfg.data.eval_every == 0 or step == cfg.trainer.total_steps):
        return await _evaluate(ctx, step, timer)
    return {}


def evaluates_at_start(cfg: Config, eval_rows: Sequence[Row] | None, start_step: int) -> bool:
    """eval.at_start applies: held-out rows and a fresh run (a resumed one evaluated its start)."""
    return bool(cfg.eval.at_start and eval_rows and start_step == 0)


async def evaluate_at_start(ctx: RunContext) -> None:
    """eval.at_start: the held-out evaluation of the starting policy before step 1 of a fresh run,
    its metrics line logged as step 0 (answers to eval/step_000000.jsonl with eval.save_answers).
    Step 1's wall time starts after it."""
    if not evaluates_at_start(ctx.cfg, ctx.eval_rows, ctx.state.start_step):
        return
    timer = StepTimer()
    metrics = await _evaluate(ctx, 0, timer)
    _add_judge_metrics(metrics)  # this evaluation's judge calls are step 0's, not step 1's
    ctx.logger.log(0, {**metrics, **timer.finish()})
    ctx.state.step_end = time.perf_counter()


async def _evaluate(ctx: RunContext, step: int, timer: StepTimer) -> dict[str, float]:
    cfg = ctx.cfg
    assert ctx.eval_rows is not None
    k = cfg.eval.samples_per_prompt
    with timer("eval"):
        ev = await ctx.runner.run_batch(ctx.eval_rows, k, evaluation=True)
    if ctx.eval_answers is not None:  # (in a thread: decoding and writing do not stall the engines' traffic)
        try:
            await asyncio.to_thread(ctx.eval_answers, step, ev)
        except OSError as e:  # the step's metrics and checkpoint matter more than the answers file
            log.warning("eval.save_answers: the answers of step %d were not written: %s", step, e)
    out = {f"eval/{name}": v for name, v in ev.metrics.items()}
    return {**out, **pass_metrics(ev, k, cfg.eval.correct_threshold)}


async def save_if_due(ctx: RunContext, step: int) -> None:
    """Checkpoint / HF export when due (mlrl.checkpoint.schedule), after the step's metrics line."""
    if ctx.saves is not None:
        await ctx.saves.after_step(step, lambda: saved_loop_state(ctx))


def saved_loop_state(ctx: RunContext) -> SavedLoopState:
    """What a checkpoint records besides the trainer state, for resume: the weight version, the
    sampler position, the config, and (async) the rows in flight, re-issued first on resume."""
    return {"weight_version": ctx.state.version, "sampler": ctx.sampler.state(), "config": dump_yaml(ctx.cfg),
            "in_flight_rows": ctx.sampler.portable([*ctx.state.in_flight.values(), *ctx.state.resume_rows])}


def _add_judge_metrics(metrics: dict[str, float]) -> None:
    judge = active_judge()
    if judge is not None:  # reward_model: the served judge's calls since the last metrics line
        metrics.update(judge.metrics())


def finish_step(ctx: RunContext, step: int, metrics: dict[str, float]) -> None:
    metrics["weight_version"] = float(ctx.state.version)
    _add_judge_metrics(metrics)
    if "timing/train" in metrics:
        rank_side = sum(metrics.get(f"timing/train/{k}", 0.0) for k in ("forward_backward", "optimizer"))
        metrics["timing/train/driver"] = metrics["timing/train"] - rank_side
    ctx.logger.log(step, metrics)
    ctx.state.history.append({"step": step, **metrics})
    if ctx.progress is not None:
        ctx.progress.update(1)
        ctx.progress.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                                 gap=f"{metrics.get('train/mismatch/logprob_gap', float('nan')):.1e}")
    ctx.state.step_end = time.perf_counter()  # the next step's wall time starts here

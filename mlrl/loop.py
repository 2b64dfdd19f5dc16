"""The RL loop, in straight-line calls (read this file first).

One step:  prompts -> episodes (engines + workflow + reward) -> samples -> advantages ->
packed micro-batches -> trainer logprobs (old, reference) -> train step -> weight sync to the
engines (versioned, verified) -> checkpoint / export -> metrics.

Two modes:
- sync (`train_sync`): on-policy; generation and training alternate; every sample of step k
  was produced by weight version k-1.
- async (`train_async`): a producer keeps `staleness` (eta) steps of generation in flight while
  the trainer trains; a sample whose oldest token is more than eta versions behind the current
  weights is dropped or re-weighted (rollout.stale_policy); the importance-sampling correction
  (algorithm.rollout_is) handles the rest. Weight updates pause the engines (in-flight requests
  finish first or are interrupted and resumed, per rollout.interrupt_on_update).

The components come ready-made in `RunContext` (built and torn down by mlrl/run.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from mlrl.algorithms.advantages import compute_advantages
from mlrl.algorithms.sampling import apply_overlong_shaping, filter_groups
from mlrl.config import Config
from mlrl.experience.packing import attach_per_sample, pack_step, unpack_per_sample
from mlrl.metrics import Timer
from mlrl.types import Sample, SampleStatus
from mlrl.workflow.runner import summarize


@dataclass
class RunContext:
    cfg: Config
    policy: Any            # mlrl.trainer.remote.RemotePolicy
    engines: Any           # mlrl.rollout.pool.EnginePool
    weight_sync: Any       # mlrl.weight_sync.WeightSync
    runner: Any            # mlrl.workflow.runner.EpisodeRunner
    sampler: Any           # mlrl.data.sampler.PromptSampler
    logger: Any            # mlrl.metrics.MetricsLogger
    checkpoint: Any        # mlrl.run.Checkpointer (save / export)
    eval_rows: list | None = None
    start_step: int = 0    # last completed step (0 = fresh run)
    version: int = 0       # weight version the engines hold
    progress: Any = None
    history: list[dict[str, float]] = field(default_factory=list)
    version_changed: asyncio.Condition | None = None  # async mode: wakes the producer after a weight update
    in_flight: dict[int, Any] = field(default_factory=dict)  # async mode: rows started, not yet trained on
    resume_rows: list[Any] = field(default_factory=list)    # rows in flight when the resumed checkpoint was saved


async def train_sync(ctx: RunContext) -> None:
    cfg = ctx.cfg
    for step in range(ctx.start_step + 1, cfg.trainer.total_steps + 1):
        timer = Timer()
        with timer("step"):
            with timer("rollout"):
                rows = ctx.sampler.next_batch(cfg.trainer.prompts_per_step)
                batch = await ctx.runner.run_batch(rows, cfg.trainer.samples_per_prompt)
            samples, sample_metrics = select_trainable(ctx, batch.samples)
            metrics = await asyncio.to_thread(train_on, ctx, samples, timer)
            with timer("weight_sync"):
                ctx.version = step
                sync_metrics = await ctx.weight_sync.sync(ctx.version)
            eval_metrics = await evaluate_if_due(ctx, step, timer)
        finish_step(ctx, step, {**batch.metrics, **sample_metrics, **metrics, **sync_metrics, **eval_metrics, **timer.pop()})
        await save_if_due(ctx, step)


async def train_async(ctx: RunContext) -> None:
    """Bounded-staleness asynchronous training: generation of up to eta steps ahead overlaps training."""
    cfg = ctx.cfg
    eta = cfg.rollout.staleness
    groups: asyncio.PriorityQueue = asyncio.PriorityQueue()  # (start index, group): oldest finished prompt first
    ctx.version_changed = asyncio.Condition()
    producer = asyncio.create_task(_produce(ctx, groups, eta))
    try:
        for step in range(ctx.start_step + 1, cfg.trainer.total_steps + 1):
            timer = Timer()
            with timer("step"):
                with timer("wait_rollout"):
                    batch_samples, batch_metrics, stale = await _collect(ctx, groups, eta)
                samples, sample_metrics = select_trainable(ctx, batch_samples)
                metrics = await asyncio.to_thread(train_on, ctx, samples, timer)  # engines keep generating meanwhile
                with timer("weight_sync"):
                    ctx.version = step
                    sync_metrics = await ctx.weight_sync.sync(ctx.version)
                async with ctx.version_changed:
                    ctx.version_changed.notify_all()
                eval_metrics = await evaluate_if_due(ctx, step, timer)
            finish_step(ctx, step, {**batch_metrics, **sample_metrics, **metrics, **sync_metrics, **eval_metrics,
                                    "async/stale_dropped": float(stale), **timer.pop()})
            await save_if_due(ctx, step)
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)


# --------------------------------------------------------------------------- the steps' parts


def select_trainable(ctx: RunContext, samples: list[Sample]) -> tuple[list[Sample], dict[str, float]]:
    """Reward shaping and group filtering before advantages (DAPO options)."""
    a, s = ctx.cfg.algorithm, ctx.cfg.rollout.sampling
    trainable = [x for x in samples if x.num_loss_tokens > 0 and x.status != SampleStatus.FAILED]
    metrics = {"samples/trainable": float(len(trainable)), "samples/total": float(len(samples))}
    versions = [x.oldest_version for x in trainable]
    if versions:
        metrics["samples/staleness_max"] = float(ctx.version - min(versions))
    if a.overlong_buffer:
        metrics["samples/overlong_penalised"] = float(apply_overlong_shaping(trainable, s.max_new_tokens, a.overlong_buffer, a.overlong_penalty))
    if a.dynamic_sampling:
        trainable, dropped = filter_groups(trainable)
        metrics["samples/groups_dropped_equal_reward"] = float(dropped)
    if not trainable:
        raise RuntimeError(f"no trainable samples in this step: {len(samples)} samples in, every one failed, had no "
                           f"policy tokens or was filtered (episode metrics: {metrics})")
    return trainable, metrics


def train_on(ctx: RunContext, samples: list[Sample], timer: Timer) -> dict[str, float]:
    """Advantages -> pack -> old / reference logprobs -> one train step (blocking trainer calls)."""
    cfg, a = ctx.cfg, ctx.cfg.algorithm
    temperature = cfg.rollout.sampling.temperature or 1.0
    kl_in_reward = a.kl_in_reward and a.kl_coef > 0   # advantages then need the logprobs first
    if not kl_in_reward:
        compute_advantages(samples, a)
    per_dp, pack_metrics = _pack(ctx, samples)
    with timer("logprobs"):
        old = _per_sample_logprobs(ctx, per_dp, samples, temperature, reference=False)
        ref = _per_sample_logprobs(ctx, per_dp, samples, temperature, reference=True) if a.kl_coef > 0 else None
    if kl_in_reward:
        compute_advantages(samples, a, ref_logprobs=ref, policy_logprobs=old)
        per_dp, pack_metrics = _pack(ctx, samples)
    flat = [mb for rank in per_dp for mb in rank]
    attach_per_sample(flat, "old_logprobs", old)
    if ref is not None and not kl_in_reward:
        attach_per_sample(flat, "ref_logprobs", ref)
    with timer("train"):
        train_metrics = ctx.policy.train_step(per_dp)
    return {**pack_metrics, **{f"train/{k}": v for k, v in train_metrics.items()}}


def _pack(ctx: RunContext, samples: list[Sample]):
    cfg = ctx.cfg
    return pack_step(samples, dp_size=ctx.policy.dp_size, token_budget=cfg.trainer.micro_batch_tokens,
                     loss_agg=cfg.algorithm.loss_agg, norm_len=cfg.rollout.sampling.max_new_tokens)


def _per_sample_logprobs(ctx: RunContext, per_dp, samples: list[Sample], temperature: float, *, reference: bool):
    out = ctx.policy.compute_logprobs(per_dp, temperature, reference=reference)
    flat = [mb for rank in per_dp for mb in rank]
    return unpack_per_sample(flat, [lp for rank in out for lp, _ in rank], len(samples))


async def evaluate_if_due(ctx: RunContext, step: int, timer: Timer) -> dict[str, float]:
    """Held-out evaluation every data.eval_every steps and at the end; returns eval/* metrics."""
    cfg = ctx.cfg
    if ctx.eval_rows and cfg.data.eval_every and (step % cfg.data.eval_every == 0 or step == cfg.trainer.total_steps):
        with timer("eval"):
            ev = await ctx.runner.run_batch(ctx.eval_rows, 1, evaluation=True)
        return {f"eval/{k}": v for k, v in ev.metrics.items()}
    return {}


async def save_if_due(ctx: RunContext, step: int) -> None:
    """Checkpoint / HF export when due. Runs after the step's metrics are written, so a checkpoint
    never exists for a step whose metrics line is missing."""
    cfg = ctx.cfg
    last = step == cfg.trainer.total_steps
    if (cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0) or (last and cfg.checkpoint.save_at_end):
        await asyncio.to_thread(ctx.checkpoint.save, ctx, step)
    if (cfg.checkpoint.hf_export_every and step % cfg.checkpoint.hf_export_every == 0) or (last and cfg.checkpoint.hf_export_at_end):
        await asyncio.to_thread(ctx.checkpoint.export_hf, ctx, step)


def finish_step(ctx: RunContext, step: int, metrics: dict[str, float]) -> None:
    metrics["weight_version"] = float(ctx.version)
    ctx.logger.log(step, metrics)
    ctx.history.append({"step": step, **metrics})
    if ctx.progress is not None:
        ctx.progress.update(1)
        ctx.progress.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                                 gap=f"{metrics.get('train/mismatch/logprob_gap', float('nan')):.1e}")


# --------------------------------------------------------------------------- async producer


async def _produce(ctx: RunContext, out: asyncio.Queue, eta: int) -> None:
    """Start prompts while the staleness bound allows (AReaL's rule): the prompts of the step that
    will train on weights v+1 may start once the engines hold version >= v - eta, i.e. at most
    (version - version_at_start + eta + 1) * prompts_per_step prompts are ever started."""
    per_step = ctx.cfg.trainer.prompts_per_step
    base = ctx.version
    started = 0
    tasks: set[asyncio.Task] = set()

    async def one(key: int, row: Any) -> None:
        out.put_nowait((key, await ctx.runner.run_group(row, ctx.cfg.trainer.samples_per_prompt)))

    try:
        while True:
            async with ctx.version_changed:
                await ctx.version_changed.wait_for(lambda: started < (ctx.version - base + eta + 1) * per_step)
            # rows that were in flight when the checkpoint we resumed from was saved come first:
            # with the sampler position saved after them, no prompt is skipped or seen twice
            row = ctx.resume_rows.pop(0) if ctx.resume_rows else ctx.sampler.next_batch(1)[0]
            ctx.in_flight[started] = row
            t = asyncio.create_task(one(started, row))
            started += 1
            tasks.add(t)
            t.add_done_callback(tasks.discard)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(ctx: RunContext, groups: asyncio.Queue, eta: int) -> tuple[list[Sample], dict[str, float], int]:
    """Take `prompts_per_step` groups; drop (or keep for re-weighting) samples older than eta versions."""
    taken = []
    for _ in range(ctx.cfg.trainer.prompts_per_step):
        key, group = await groups.get()
        ctx.in_flight.pop(key)
        taken.append(group)
    samples, stale = [], 0
    for s in (s for g in taken for s in g.samples):
        if ctx.version - s.oldest_version > eta and s.oldest_version >= 0 and ctx.cfg.rollout.stale_policy == "drop":
            stale += 1
            continue
        samples.append(s)
    return samples, summarize(taken), stale

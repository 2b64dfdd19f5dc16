"""Asynchronous RL (rollout.staleness > 0): a producer keeps up to `staleness` (eta) steps of
generation in flight while the trainer trains (AReaL's bounded staleness).

A sample whose oldest token is more than eta versions behind the current weights is dropped or
re-weighted (rollout.stale_policy); the importance-sampling correction (algorithm.rollout_is)
handles the rest. Weight syncs pause the engines (in-flight requests finish first or are
interrupted and resumed, per rollout.interrupt_on_sync). Each step reuses mlrl/loop.py's parts
(selection, the train phase, evaluation, metrics, the save schedule); what only this mode needs
(the producer's wake-up condition, its idle flag, the refills owed to dynamic sampling) is its
`AsyncState`, made by `train_async`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from mlrl.loop import (
    RunContext,
    Selection,
    attach_routing,
    evaluate_if_due,
    finish_step,
    save_if_due,
    sync_timing,
    train_phase_in_thread,
    train_timing,
)
from mlrl.metrics import StepTimer
from mlrl.types import Row, Sample
from mlrl.workflow.runner import summarize

log = logging.getLogger(__name__)


@dataclass
class AsyncState:
    """The producer's side of async mode."""

    version_changed: asyncio.Condition = field(default_factory=asyncio.Condition)  # wakes the producer
    # set while the producer waits for the next weight version with none of its groups running,
    # i.e. the engines are idle until the next weight sync
    producer_idle: asyncio.Event = field(default_factory=asyncio.Event)
    extra_prompts: int = 0  # groups dropped by dynamic sampling: the producer starts as many more
    warned_unknown_versions: bool = False  # a sample without weight versions was dropped (said once)


async def train_async(ctx: RunContext) -> None:
    """Bounded-staleness asynchronous training: generation of up to eta steps ahead overlaps training."""
    cfg = ctx.cfg
    eta = cfg.rollout.staleness
    groups: asyncio.PriorityQueue = asyncio.PriorityQueue()  # (start index, group): oldest finished prompt first
    st = AsyncState()
    producer = asyncio.create_task(produce(ctx, st, groups, eta))
    try:
        for step in range(ctx.state.start_step + 1, cfg.trainer.total_steps + 1):
            timer = ctx.step_timer()
            with timer("rollout"):  # the wait for samples: generation itself runs in the background
                samples, rollout_metrics, stale = await collect(ctx, st, groups, eta, step)
            # engines keep generating; once the producer has run up to the staleness bound and its
            # groups finished, they pause while the trainer still trains (the sync finds them paused)
            async with ctx.trainer_busy:  # through the sync: see guarded_refresh
                metrics = await train_and_pause_when_idle(ctx, st, samples, timer, step)
                with timer("sync"):
                    ctx.state.version = step
                    sync_metrics = await ctx.weight_sync.sync(ctx.state.version)
            await wake_producer(st)
            eval_metrics = await evaluate_if_due(ctx, step, timer)
            timing = timer.finish(overlapped_rollout=True, details=sync_timing(sync_metrics) | train_timing(metrics))
            finish_step(ctx, step, {**rollout_metrics, **metrics, **sync_metrics, **eval_metrics,
                                    "async/stale_dropped": float(stale), **timing})
            await save_if_due(ctx, step)
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)


async def wake_producer(st: AsyncState) -> None:
    """Tell the producer its bound moved (a new weight version, or a group dropped to refill). The
    idle flag is cleared here, not only by the producer once it runs: a step whose groups are all
    queued already never yields to it before training, and a stale flag would pause the engines
    while the producer is about to start prompts."""
    async with st.version_changed:
        st.producer_idle.clear()
        st.version_changed.notify_all()


async def train_and_pause_when_idle(ctx: RunContext, st: AsyncState, samples: list[Sample], timer: StepTimer,
                                    step: int) -> dict[str, float]:
    """The step's train phase, and the engines' pause (vLLM's /pause sleeps 20 ms) moved off the
    weight sync's path when the producer goes idle during training. After `collect` only a weight
    sync can give the producer work again, so an idle producer stays idle until the sync."""
    train = asyncio.create_task(train_phase_in_thread(ctx, samples, timer, step))
    idle = asyncio.create_task(st.producer_idle.wait())
    try:
        await asyncio.wait({train, idle}, return_when=asyncio.FIRST_COMPLETED)
        if idle.done() and not train.done():
            await ctx.engines.pause()
    finally:  # the trainer call always completes before the step goes on (or fails)
        idle.cancel()
        await asyncio.gather(idle, train, return_exceptions=True)
    return train.result()


async def produce(ctx: RunContext, st: AsyncState, out: asyncio.Queue, eta: int) -> None:
    """Start prompts while the staleness bound allows (AReaL's rule): the prompts of the step that
    will train on weights v+1 may start once the engines hold version >= v - eta, i.e. at most
    (version - version_at_start + eta + 1) * prompts_per_step prompts are ever started."""
    per_step = ctx.cfg.trainer.prompts_per_step
    state = ctx.state
    base = state.version
    started = 0
    tasks: set[asyncio.Task] = set()
    blocked = False  # waiting for the bound to move
    idle = st.producer_idle

    async def one(key: int, row: Row) -> None:
        try:
            group = await ctx.runner.run_group(row, ctx.cfg.trainer.samples_per_prompt)
        except Exception as e:  # not the workflow's failure (those are episodes): collect stops the run with it,
            out.put_nowait((key, e))  # where the task would have died unseen and the step waited for it forever
            return
        out.put_nowait((key, group))

    def finished(t: asyncio.Task) -> None:
        tasks.discard(t)
        if blocked and not tasks:
            idle.set()

    def may_start() -> bool:
        return started < (state.version - base + eta + 1) * per_step + st.extra_prompts

    cond = st.version_changed
    try:
        while True:
            async with cond:
                blocked = not may_start()
                if blocked and not tasks:
                    idle.set()
                # the predicate is re-evaluated while we wait, within this iteration: it reads the
                # current `started`
                await cond.wait_for(may_start)
                blocked = False
                idle.clear()
            # rows that were in flight when the checkpoint we resumed from was saved come first:
            # with the sampler position saved after them, no prompt is skipped or seen twice
            row = state.resume_rows.pop(0) if state.resume_rows else ctx.sampler.next_batch(1)[0]
            state.in_flight[started] = row
            t = asyncio.create_task(one(started, row))
            started += 1
            tasks.add(t)
            t.add_done_callback(finished)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(ctx: RunContext, st: AsyncState, groups: asyncio.Queue, eta: int,
                  step: int = 0) -> tuple[list[Sample], dict[str, float], int]:
    """Take `prompts_per_step` groups (with dynamic sampling: until that many informative groups
    are kept, at most max_rounds * prompts_per_step groups; each dropped group lets the producer
    start one more prompt); drop (or keep for re-weighting) samples older than eta versions.
    Returns (trainable samples, metrics, stale samples dropped)."""
    cfg, ds, state = ctx.cfg, ctx.cfg.algorithm.dynamic_sampling, ctx.state
    want = cfg.trainer.prompts_per_step
    limit = ds.max_rounds * want if ds.enabled else want
    sel, taken, stale, granted = Selection(ctx), [], 0, 0
    while len(taken) < want or (ds.enabled and sel.groups_kept < want and len(taken) < limit):
        key, group = await groups.get()
        if isinstance(group, Exception):
            raise group
        state.in_flight.pop(key)
        taken.append(group)
        fresh = []
        for s in group.samples:
            # a sample whose versions are all unknown (a workflow result without them) cannot be shown
            # within the bound: dropped with the stale ones (said once), as it was trained however old
            unknown = s.oldest_version < 0
            if cfg.rollout.stale_policy == "drop" and (unknown or state.version - s.oldest_version > eta):
                stale += 1
                if unknown and not st.warned_unknown_versions:
                    st.warned_unknown_versions = True
                    log.warning("rollout.stale_policy=drop: a sample without weight versions on its policy tokens "
                                "(the workflow's result gave none, e.g. an AReaL dict without 'versions') is "
                                "dropped as stale: its staleness cannot be bounded (counted in async/stale_dropped)")
            else:
                fresh.append(s)
        sel.routing_missing += await attach_routing(ctx, fresh)
        if not sel.add(fresh) and ds.enabled:
            st.extra_prompts += 1
            granted += 1
            await wake_producer(st)
    # a step that stopped at max_rounds * prompts_per_step took fewer extra groups than it granted:
    # the credits it did not use are taken back, or the in-flight prompts would grow past the
    # staleness bound for good (and age into stale, dropped, credit-earning groups)
    unused = granted - max(0, len(taken) - want)
    if unused > 0:
        st.extra_prompts -= unused
    ctx.check_failures(step, taken)
    return sel.samples, {**summarize(taken), **sel.metrics(len(taken) / want)}, stale

"""The async producer's staleness rule and its resume bookkeeping, with a scripted engine."""

import asyncio

from helpers.scripted_engine import ScriptedEngine

from mlrl.config import load_config
from mlrl.data.sampler import PromptSampler
from mlrl.loop import LoopState, RunContext
from mlrl.loop_async import AsyncState, collect, produce
from mlrl.workflow import EpisodeRunner, build_workflow_from_config, gconfig_from_sampling, load_hf_tokenizer
from mlrl.workflow import runner as runner_mod

P, N, ETA = 2, 2, 1


def _ctx(sampler, version=0, resume_rows=()):
    cfg = load_config(None, [f"trainer.prompts_per_step={P}", f"trainer.samples_per_prompt={N}",
                             f"rollout.staleness={ETA}", "algorithm.rollout_is=tis", "workflow.reward_workers=0"])
    tok = load_hf_tokenizer("builtin:tiny-llama")
    wf = build_workflow_from_config(cfg.workflow, tokenizer=tok, gconfig=gconfig_from_sampling(cfg.rollout.sampling))
    engine = ScriptedEngine(version=version)
    runner = EpisodeRunner.from_config(cfg.workflow, wf, engine)
    return RunContext(
        cfg=cfg,
        policy=None,
        engines=engine,
        weight_sync=None,
        runner=runner,
        sampler=sampler,
        logger=None,
        checkpoint=None,
        saves=None,
        state=LoopState(version=version, resume_rows=list(resume_rows)),
    )


async def _one_step():
    """(AsyncState, collect's result) of one step on 8 copy rows, in order, the producer running beside."""
    rows = [{"messages": [{"role": "user", "content": f"copy {i}"}], "answer": str(i), "row": i} for i in range(8)]
    ctx = _ctx(PromptSampler(rows, seed=0, shuffle=False))
    q: asyncio.PriorityQueue = asyncio.PriorityQueue()
    st = AsyncState()
    prod = asyncio.create_task(produce(ctx, st, q, ETA))
    try:
        return st, await asyncio.wait_for(collect(ctx, st, q, ETA), timeout=10)
    finally:
        prod.cancel()
        await asyncio.gather(prod, return_exceptions=True)


async def _steps(ctx, n, started):
    q: asyncio.PriorityQueue = asyncio.PriorityQueue()
    st = AsyncState()
    prod = asyncio.create_task(produce(ctx, st, q, ETA))
    trained, dropped = [], 0
    state = ctx.state
    base = state.version
    for _ in range(n):
        await asyncio.sleep(0.05)  # let the producer run ahead as far as the bound allows
        assert len(started) <= (state.version - base + ETA + 1) * P  # the start rule
        samples, metrics, stale = await collect(ctx, st, q, ETA)
        assert all(state.version - s.oldest_version <= ETA for s in samples)  # the bound holds for what is trained
        trained += sorted({s.metadata["row"] for s in samples})
        dropped += stale
        state.version += 1
        ctx.engines.version = state.version  # the "weight sync"
        async with st.version_changed:
            st.version_changed.notify_all()
    snapshot = (ctx.sampler.state(), [r["row"] for r in state.in_flight.values()], list(state.in_flight.values()))
    prod.cancel()
    await asyncio.gather(prod, return_exceptions=True)
    return trained, dropped, snapshot


async def test_start_rule_bound_and_resume_reissues_in_flight_rows(monkeypatch):
    started: list[int] = []
    orig = runner_mod.EpisodeRunner.run_group

    async def tagged(self, data, n, **kw):  # remember which row each sample came from
        started.append(data["row"])
        g = await orig(self, data, n, **kw)
        for s in g.samples:
            s.metadata["row"] = data["row"]
        return g

    monkeypatch.setattr(runner_mod.EpisodeRunner, "run_group", tagged)
    rows = [
        {"messages": [{"role": "user", "content": f"copy {i % 10}"}], "answer": str(i % 10), "row": i}
        for i in range(40)
    ]
    first, dropped_a, (state, in_flight_ids, in_flight) = await _steps(_ctx(PromptSampler(rows, seed=7)), 3, started)
    started_a = list(started)
    assert in_flight_ids  # the producer had run ahead when the "checkpoint" was taken
    assert len(first) + dropped_a // N + len(in_flight_ids) == len(started_a)  # every started prompt accounted for
    started.clear()
    ctx_b = _ctx(PromptSampler.from_state(rows, state, seed=7), version=3, resume_rows=in_flight)
    second, dropped_b, (_, in_flight_b, _) = await _steps(ctx_b, 3, started)
    assert started[: len(in_flight_ids)] == in_flight_ids  # re-issued first, in order
    new_b = started[len(in_flight_ids):]
    assert len(second) + dropped_b // N + len(in_flight_b) == len(started)  # run B accounts for every prompt too
    assert len(second) >= P and new_b  # it trained and drew new prompts: the two checks below are not vacuous
    assert not set(new_b) & set(started_a)  # the sampler continues after what run A drew: nothing twice
    assert not set(first) & set(second)


async def test_producer_signals_idle_only_when_blocked_by_the_bound_with_nothing_running():
    rows = [{"messages": [{"role": "user", "content": f"copy {i % 10}"}], "answer": str(i % 10)} for i in range(20)]
    ctx = _ctx(PromptSampler(rows, seed=3))
    ctx.engines.delay_s = 0.05  # groups take a while: the producer is blocked before they finish
    st = AsyncState()
    q: asyncio.PriorityQueue = asyncio.PriorityQueue()
    prod = asyncio.create_task(produce(ctx, st, q, ETA))
    try:
        await asyncio.sleep(0.02)
        # (ETA + 1) * P prompts started, the bound reached, but their groups still run: not idle
        assert q.qsize() == 0 and len(ctx.state.in_flight) == (ETA + 1) * P
        assert not st.producer_idle.is_set()
        await asyncio.wait_for(st.producer_idle.wait(), 5.0)  # ... until the last one finished
        assert q.qsize() == (ETA + 1) * P
        ctx.state.version += 1  # a weight sync moves the bound: new groups start, the producer is busy again
        async with st.version_changed:
            st.version_changed.notify_all()
        await asyncio.sleep(0.01)
        assert not st.producer_idle.is_set() and len(ctx.state.in_flight) == (ETA + 2) * P
        await asyncio.wait_for(st.producer_idle.wait(), 5.0)
        assert q.qsize() == (ETA + 2) * P
    finally:
        prod.cancel()
        await asyncio.gather(prod, return_exceptions=True)


class _PausingPool:
    def __init__(self):
        self.events = []

    async def pause(self, mode=None):
        self.events.append("pause")


async def test_engines_pause_during_training_once_the_producer_is_idle(monkeypatch):
    import threading

    from mlrl import loop_async

    release = threading.Event()

    def train_phase(ctx, samples, timer, step):  # the trainer call, in its thread
        release.wait(5)
        ctx.engines.events.append("trained")
        return {"train/loss": 1.0}

    from mlrl import loop

    monkeypatch.setattr(loop, "train_phase", train_phase)  # what train_phase_in_thread runs
    ctx = RunContext(cfg=None, policy=None, engines=_PausingPool(), weight_sync=None, runner=None, sampler=None,
                     logger=None, checkpoint=None, saves=None)
    st = AsyncState()
    # the producer goes idle while the trainer trains: the engines pause before training ends
    step = asyncio.create_task(loop_async.train_and_pause_when_idle(ctx, st, [], None, 1))
    await asyncio.sleep(0.02)
    st.producer_idle.set()
    await asyncio.sleep(0.02)
    release.set()
    assert await step == {"train/loss": 1.0} and ctx.engines.events == ["pause", "trained"]
    # a producer still busy when training ends: no pause here (the weight sync pauses the engines)
    ctx.engines.events.clear()
    st.producer_idle.clear()
    assert await loop_async.train_and_pause_when_idle(ctx, st, [], None, 2) == {"train/loss": 1.0}
    assert ctx.engines.events == ["trained"]


async def test_a_moved_bound_clears_the_idle_flag_before_the_producer_runs():
    # a step whose groups are all queued already does not yield to the producer before training:
    # the flag must not still say "idle" from before the weight sync
    from mlrl import loop_async

    st = loop_async.AsyncState()
    st.producer_idle.set()
    await loop_async.wake_producer(st)
    assert not st.producer_idle.is_set()


class _SyncStub:
    """The weight sync's `sync` (records when it ran) for the loops' lock tests."""

    def __init__(self, order):
        self.order = order

    async def sync(self, version, hooks=None):
        await asyncio.sleep(0.02)  # a refresh started now would run inside the sync
        self.order.append(f"synced v{version}")
        return {}


def _patch_step(monkeypatch, order, release):
    from mlrl import loop, loop_async

    def train_phase(ctx, samples, timer, step):
        release.wait(5)
        order.append("trained")
        return {}

    async def nothing(*a, **k):
        return {}

    monkeypatch.setattr(loop, "train_phase", train_phase)
    for mod in (loop, loop_async):
        monkeypatch.setattr(mod, "evaluate_if_due", nothing)
        monkeypatch.setattr(mod, "save_if_due", nothing)
        monkeypatch.setattr(mod, "finish_step", lambda ctx, step, metrics: None)


def _lock_ctx(order, staleness):
    cfg = load_config(None, ["trainer.total_steps=1", f"rollout.staleness={staleness}"])
    return RunContext(cfg=cfg, policy=None, engines=_PausingPool(), weight_sync=_SyncStub(order), runner=None,
                      sampler=None, logger=None, checkpoint=None, saves=None)


async def _refresh_during_train(ctx, order, release, run):
    """A restarted engine's refresh, asked for while the trainer trains: it must wait for the step's
    weight sync too (between the train phase and the sync the trainer holds the next version's
    weights, which the refresh would push labelled with the pool's current version)."""
    from mlrl import loop

    async def refresh():
        order.append("refreshed")

    step = asyncio.create_task(run(ctx))
    while not ctx.trainer_busy.locked():
        await asyncio.sleep(0.005)
    refreshing = asyncio.create_task(loop.guarded_refresh(ctx.trainer_busy, refresh)())
    await asyncio.sleep(0.05)
    assert order == []  # the refresh waits while the trainer trains
    release.set()
    await asyncio.wait_for(asyncio.gather(step, refreshing), 10)
    assert order == ["trained", "synced v1", "refreshed"]


async def test_a_restarted_engines_refresh_waits_for_the_sync_loops_train_phase_and_sync(monkeypatch):
    import threading

    from mlrl import loop

    order, release = [], threading.Event()
    _patch_step(monkeypatch, order, release)

    async def rollout_sync(ctx, step):
        return [], {}

    monkeypatch.setattr(loop, "rollout_sync", rollout_sync)
    await _refresh_during_train(_lock_ctx(order, 0), order, release, loop.train_sync)


async def test_a_restarted_engines_refresh_waits_for_the_async_loops_train_phase_and_sync(monkeypatch):
    import threading

    from mlrl import loop_async

    order, release = [], threading.Event()
    _patch_step(monkeypatch, order, release)

    async def collect(ctx, st, groups, eta, step):
        return [], {}, 0

    async def produce(ctx, st, out, eta):
        await asyncio.Event().wait()

    monkeypatch.setattr(loop_async, "collect", collect)
    monkeypatch.setattr(loop_async, "produce", produce)
    await _refresh_during_train(_lock_ctx(order, 1), order, release, loop_async.train_async)


async def test_a_group_whose_run_raises_stops_the_step_instead_of_vanishing(monkeypatch):
    """An exception out of run_group (a bug outside the workflow: the workflow's own failures are
    episodes) killed the producer's task unseen; its prompt stayed in flight and its slot was gone, so
    once eta * prompts_per_step such groups were lost, collect waited forever. collect raises it now."""
    import pytest

    orig = runner_mod.EpisodeRunner.run_group

    async def broken_for_row_1(self, data, n, **kw):
        if data["row"] == 1:
            raise RuntimeError("runner bug on row 1")
        return await orig(self, data, n, **kw)

    monkeypatch.setattr(runner_mod.EpisodeRunner, "run_group", broken_for_row_1)
    with pytest.raises(RuntimeError, match="runner bug on row 1"):
        await _one_step()


async def test_samples_without_weight_versions_are_dropped_as_stale_not_trained_however_old(monkeypatch):
    """A workflow result without versions (-1 on every token) made oldest_version -1, which the
    staleness filter exempted: such samples were trained however many versions old. Under `drop`
    they are dropped with the stale ones; one unknown token no longer hides the known ones."""
    from mlrl.types import Sample

    s = Sample(tokens=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], rollout_logprobs=[0.0] * 4, versions=[-1, -1, 3, 5],
               reward=0.0)
    assert s.oldest_version == 3  # the unknown token is left out, not taken as the minimum
    orig = runner_mod.EpisodeRunner.run_group

    async def no_versions(self, data, n, **kw):
        g = await orig(self, data, n, **kw)
        for x in g.samples:
            x.versions = [-1] * len(x.versions)
        return g

    monkeypatch.setattr(runner_mod.EpisodeRunner, "run_group", no_versions)
    st, (samples, metrics, stale) = await _one_step()
    assert samples == [] and stale == P * N and st.warned_unknown_versions
    assert "samples/staleness_max" not in metrics  # no known version: no "version + 1"

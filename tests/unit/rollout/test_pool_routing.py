"""EnginePool logic against fake engine processes (fake_engine.py): routing, caps, sticky sessions,
bad requests, engine death, pause/resume with interrupted (partial) rollouts, abort, timeout."""

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest

from mlrl.config.schema import RolloutConfig
from mlrl.rollout import EnginePool, EngineState
from mlrl.types import GenerationHyperparameters, ModelRequest, StopReason

FAKE = Path(__file__).with_name("fake_engine.py")
VOCAB = 50


def _expected(prompt: list[int], n: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = (last + 1) % VOCAB
        out.append(last)
    return out


@pytest.fixture
async def make_pool(tmp_path, monkeypatch):
    pools = []

    async def make(num_engines=2, cap=3, timeout_s=30.0, delay_s=0.01, interrupt=False):
        monkeypatch.setenv("FAKE_TOKEN_DELAY_S", str(delay_s))
        model = tmp_path / f"model{len(pools)}"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
        cfg = RolloutConfig(num_engines=num_engines, max_concurrent_requests=cap, startup_timeout_s=30,
                            request_timeout_s=timeout_s, interrupt_on_sync=interrupt)
        pool = EnginePool(cfg, model, run_dir=tmp_path / f"run{len(pools)}",
                          command=[sys.executable, str(FAKE), "--host", "{host}", "--port", "{port}"])
        pools.append(pool)
        return await pool.start()

    yield make
    for p in pools:
        await p.shutdown()


async def _stats(engine) -> dict:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {engine.server.spec.token}"}) as c:
        return (await c.get(f"{engine.server.url}/stats")).json()


async def _wait_generating(pool, running: int, timeout_s: float = 30.0) -> None:
    """Until `running` requests run at once on the engines (the fake's peak count), then a few
    token delays more: every request has produced some tokens, none has finished. A fixed sleep
    raced with connection set-up on a loaded machine."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while sum([(await _stats(e))["peak"] for e in pool.engines]) < running:
        assert loop.time() < deadline, f"fewer than {running} requests reached the engines in {timeout_s} s"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)


def _req(prompt, n, **kw) -> ModelRequest:
    return ModelRequest(input_ids=list(prompt), gconfig=GenerationHyperparameters(max_new_tokens=n), **kw)


async def test_least_loaded_routing_respects_the_per_engine_cap(make_pool):
    pool = await make_pool(cap=3)
    reqs = [_req([1, i], 12) for i in range(12)]
    resps = await asyncio.gather(*(pool.agenerate(r) for r in reqs))
    for r, resp in zip(reqs, resps):
        assert resp.stop_reason == StopReason.LENGTH and resp.error is None
        assert resp.output_tokens == _expected(r.input_ids, 12)
        assert resp.output_logprobs == pytest.approx([-(2 + k + 1) / 100 for k in range(12)])
        assert resp.output_versions == [0] * 12 and resp.rid == r.rid
    used = {resp.engine for resp in resps}
    assert used == {"engine-0", "engine-1"}
    for e in pool.engines:
        assert 1 <= (await _stats(e))["peak"] <= 3
        assert e.in_flight == 0


async def test_sticky_sessions_stay_on_one_engine(make_pool):
    pool = await make_pool(cap=8)

    async def conversation(sid):
        engines = []
        for turn in range(4):
            resp = await pool.agenerate(_req([1, turn], 3, session_id=sid))
            engines.append(resp.engine)
        return engines

    results = await asyncio.gather(*(conversation(f"s{i}") for i in range(4)))
    for engines in results:
        assert len(set(engines)) == 1
    assert {e[0] for e in results} == {"engine-0", "engine-1"}  # sessions are still spread


async def test_bad_requests_fail_alone(make_pool):
    pool = await make_pool()
    too_long = await pool.agenerate(_req(list(range(1, 70)), 4))
    assert too_long.stop_reason == StopReason.ERROR and "maximum model length" in too_long.error
    bad_top_p = await pool.agenerate(ModelRequest(input_ids=[1, 2], gconfig=GenerationHyperparameters(top_p=2.0)))
    assert bad_top_p.stop_reason == StopReason.ERROR and "top_p" in bad_top_p.error
    n2 = await pool.agenerate(ModelRequest(input_ids=[1, 2], gconfig=GenerationHyperparameters(n_samples=2)))
    assert n2.stop_reason == StopReason.ERROR and "n_samples" in n2.error
    empty = await pool.agenerate(ModelRequest(input_ids=[]))
    assert empty.stop_reason == StopReason.ERROR and "input_ids" in empty.error
    ok = await pool.agenerate(_req([1, 2], 5))
    assert ok.stop_reason == StopReason.LENGTH and ok.output_tokens == _expected([1, 2], 5)
    assert all(e.state == EngineState.READY for e in pool.engines)


async def test_engine_death_reissues_every_request_exactly_once(make_pool):
    pool = await make_pool(cap=8, delay_s=0.02)
    reqs = [_req([1, i], 40) for i in range(10)]
    tasks = [asyncio.create_task(pool.agenerate(r)) for r in reqs]
    await asyncio.sleep(0.3)
    assert pool.engines[1].in_flight > 0
    pool.engines[1].server.crash()
    resps = await asyncio.gather(*tasks)
    assert [r.rid for r in resps] == [r.rid for r in reqs]  # one answer per request, in order
    for r, resp in zip(reqs, resps):
        assert resp.stop_reason == StopReason.LENGTH, resp.error
        assert resp.output_tokens == _expected(r.input_ids, 40)
        assert len(resp.output_logprobs) == len(resp.output_versions) == 40
    assert pool.stats["failovers"] >= 1 and pool.stats["engine_deaths"] == 1
    for _ in range(200):  # restarted in the background
        if pool.engines[1].state == EngineState.READY:
            break
        await asyncio.sleep(0.1)
    assert pool.engines[1].state == EngineState.READY and pool.engines[1].restarts == 1
    again = await asyncio.gather(*(pool.agenerate(_req([1, i], 3)) for i in range(8)))
    assert {r.engine for r in again} == {"engine-0", "engine-1"}


async def test_pause_abort_interrupts_and_resumes_with_versions(make_pool):
    pool = await make_pool(cap=8, delay_s=0.02, interrupt=True)
    reqs = [_req([1, i], 50) for i in range(8)]  # 1 s of tokens: none may finish before the pause on a loaded machine
    tasks = [asyncio.create_task(pool.agenerate(r)) for r in reqs]
    await _wait_generating(pool, len(reqs))
    await pool.pause()  # interrupt_on_sync=True -> abort
    assert all(e.in_flight == 0 for e in pool.engines)
    assert not any(t.done() for t in tasks)  # interrupted requests wait for the resume
    for e in pool.engines:
        await e.client.set_weight_version(1)
    pool.commit_version(1, pool.live_engines())
    await pool.resume()
    resps = await asyncio.gather(*tasks)
    mixed = 0
    for r, resp in zip(reqs, resps):
        assert resp.stop_reason == StopReason.LENGTH
        assert resp.output_tokens == _expected(r.input_ids, 50)  # the continuation picks up where it stopped
        assert resp.output_versions == sorted(resp.output_versions) and set(resp.output_versions) <= {0, 1}
        mixed += len(set(resp.output_versions)) == 2
    assert mixed >= 1 and pool.stats["interrupted"] >= 1
    assert pool.version == 1


def _group(prompt, n, samples, **kw) -> ModelRequest:
    return ModelRequest(input_ids=list(prompt), gconfig=GenerationHyperparameters(max_new_tokens=n, n_samples=samples),
                        **kw)


async def test_a_group_is_one_engine_request_and_interrupted_samples_continue_alone(make_pool):
    pool = await make_pool(num_engines=1, cap=8, delay_s=0.02, interrupt=True)
    req = ModelRequest(input_ids=[1, 4], gconfig=GenerationHyperparameters(max_new_tokens=30, n_samples=4, seed=100))
    task = asyncio.create_task(pool.agenerate_group(req))
    await _wait_generating(pool, 1)
    assert (await _stats(pool.engines[0]))["peak"] == 1            # one request carries the 4 samples
    await pool.pause()                                              # interrupt: every sample is partial
    await pool.engines[0].client.set_weight_version(1)
    pool.commit_version(1, pool.live_engines())
    await pool.resume()
    resps = await task
    assert [r.rid for r in resps] == [f"{req.rid}:{i}" for i in range(4)]
    for resp in resps:
        assert resp.stop_reason == StopReason.LENGTH and resp.error is None
        assert resp.output_tokens == _expected(req.input_ids, 30)  # each continuation picks up where it stopped
        assert resp.output_versions == sorted(resp.output_versions) and set(resp.output_versions) == {0, 1}
    stats = await _stats(pool.engines[0])
    assert len(stats["served"]) == 1 + 4 and pool.stats["interrupted"] == 4  # the group, then one continuation each
    # sample i continues on seed + i, as vLLM seeds sample i of the group: on the group's own seed, samples cut at
    # the same prefix would continue identically
    assert stats["seeds"][0] == 100 and sorted(stats["seeds"][1:]) == [100, 101, 102, 103]
    assert pool.engines[0].in_flight == 0


async def test_group_errors_and_validation(make_pool):
    pool = await make_pool(num_engines=1, cap=8)
    too_long = await pool.agenerate_group(_group(list(range(70)), 3, samples=2))
    assert [r.stop_reason for r in too_long] == [StopReason.ERROR] * 2 and "maximum model length" in too_long[0].error
    zero = await pool.agenerate_group(_group([1, 2], 3, samples=0))
    assert len(zero) == 1 and "n_samples=0" in zero[0].error
    ok = await pool.agenerate_group(_group([1, 2], 3, samples=3))
    assert [r.output_tokens for r in ok] == [_expected([1, 2], 3)] * 3
    single = await pool.agenerate(_group([1, 2], 3, samples=3))   # agenerate keeps refusing n > 1
    assert single.stop_reason == StopReason.ERROR and "call agenerate once per sample" in single.error


async def test_pause_wait_lets_in_flight_finish_and_holds_new_requests(make_pool):
    pool = await make_pool(cap=8, delay_s=0.01)
    tasks = [asyncio.create_task(pool.agenerate(_req([1, i], 20))) for i in range(4)]
    await asyncio.sleep(0.05)
    await pool.pause("wait")
    assert all(t.done() for t in tasks)
    assert all(t.result().output_versions == [0] * 20 for t in tasks)
    late = asyncio.create_task(pool.agenerate(_req([1, 2], 3)))
    await asyncio.sleep(0.3)
    assert not late.done()
    await pool.resume()
    assert (await late).output_tokens == _expected([1, 2], 3)


async def test_a_second_pause_of_paused_idle_engines_costs_nothing(make_pool):
    """The sync loop pauses the idle engines while the trainer trains; the weight sync's own pause
    then finds them paused and sends nothing (vLLM's /pause sleeps 20 ms). After a resume, or with a
    request in flight, pausing goes to the engines again."""
    pool = await make_pool(num_engines=2, delay_s=0.01)
    await pool.pause("wait")
    counts = [(await _stats(e))["pauses"] for e in pool.engines]
    await pool.pause("wait")
    assert [(await _stats(e))["pauses"] for e in pool.engines] == counts
    await pool.resume()
    await pool.pause("wait")
    assert [(await _stats(e))["pauses"] for e in pool.engines] == [c + 1 for c in counts]
    await pool.resume()


async def test_abort_returns_the_partial_output(make_pool):
    pool = await make_pool(delay_s=0.02)
    req = _req([1, 3], 50)
    task = asyncio.create_task(pool.agenerate(req))
    await asyncio.sleep(0.3)
    assert await pool.abort(req.rid)
    resp = await task
    assert resp.stop_reason == StopReason.ABORT
    assert 0 < resp.output_len < 50 and resp.output_tokens == _expected([1, 3], resp.output_len)
    assert not await pool.abort("no-such-request")


async def test_request_timeout_is_an_error_response(make_pool):
    pool = await make_pool(num_engines=1, timeout_s=1.0)
    await pool.pause("wait")
    resp = await pool.agenerate(_req([1, 2], 3))
    assert resp.stop_reason == StopReason.ERROR and "timed out" in resp.error
    await pool.resume()


async def test_a_timed_out_group_fails_its_unfinished_samples(make_pool):
    """Before, a group's timeout returned every unfinished sample as finished (STOP, the response's
    default), with its partial tokens or none: rlvr scored and trained them as complete answers."""
    pool = await make_pool(num_engines=1, timeout_s=1.0, delay_s=0.05)
    resps = await pool.agenerate_group(_group([1, 2], 100, samples=3))  # 100 tokens take 5 s
    assert [r.stop_reason for r in resps] == [StopReason.ERROR] * 3
    assert all("timed out" in r.error for r in resps)
    assert pool.stats["timeouts"] == 1


async def test_chat_variant_and_stale_engines(make_pool):
    pool = await make_pool(num_engines=1)
    resp = await pool.achat([{"role": "user", "content": "hello"}], GenerationHyperparameters(max_new_tokens=4))
    assert resp.input_tokens == [1, 5] and resp.output_tokens == _expected([1, 5], 4)
    # after a version bump, a restarted engine holds the folder's weights: stale until refreshed
    refreshed = asyncio.Event()

    async def refresher():
        pool.commit_version(pool.version, pool.live_engines())
        refreshed.set()

    pool.refresher = refresher
    pool.commit_version(3, pool.live_engines())
    pool.engines[0].server.crash()
    resp = await pool.agenerate(_req([1, 2], 3))  # waits for the restart + refresh, then succeeds
    assert refreshed.is_set() and resp.stop_reason == StopReason.LENGTH


@pytest.mark.parametrize("pushed", [True, False])
async def test_a_restart_before_the_first_trained_sync_is_stale_once_weights_were_pushed(make_pool, pushed):
    """model.init_from / a resume: the first sync pushes the trainer's weights, labelled version 0 like
    the folder's. An engine restarted after that push loads the folder: stale, refreshed before it
    serves (it was marked ready and served the folder's model as version 0). After a checked load
    of the folder itself (pushed=False) a restart is current."""
    pool = await make_pool(num_engines=1)
    refreshes = []

    async def refresher():
        refreshes.append(pool.version)
        pool.commit_version(pool.version, pool.live_engines())

    pool.refresher = refresher
    pool.commit_version(0, pool.live_engines(), pushed=pushed)
    pool.engines[0].server.crash()
    resp = await pool.agenerate(_req([1, 2], 3))  # waits for the restart (and the refresh, when one is due)
    assert resp.stop_reason == StopReason.LENGTH and refreshes == ([0] if pushed else [])


async def _refresh_that_fails(pool):
    await pool.pause()  # as the weight sync does: it leaves the engines paused when it fails
    raise RuntimeError("transfer broke")


async def test_a_failed_refresh_of_a_restarted_engine_takes_it_out_and_the_pool_goes_on(make_pool):
    """The refresh runs in the pool's background restart task, where nobody awaits it: it used to
    leave the pool paused (every request then waited until its timeout) and its error unseen."""
    pool = await make_pool(num_engines=2)
    pool.refresher = lambda: _refresh_that_fails(pool)
    pool.commit_version(3, pool.live_engines())  # weights were pushed: a restarted engine is stale
    pool.engines[0].server.crash()
    resp = await pool.agenerate(_req([1, 2], 3))  # fails over to engine-1
    assert resp.stop_reason == StopReason.LENGTH
    for _ in range(300):
        if pool.stats["refresh_failures"]:
            break
        await asyncio.sleep(0.05)
    assert pool.stats["refresh_failures"] == 1
    assert pool.engines[0].state == EngineState.DEAD and not pool.engines[0].server.alive()
    assert not pool.paused
    resp = await asyncio.wait_for(pool.agenerate(_req([1, 3], 3)), 10)
    assert resp.stop_reason == StopReason.LENGTH and resp.engine == "engine-1"


async def test_a_failed_refresh_leaves_a_later_pause_alone(make_pool):
    """The loop's next train phase / weight sync may pause the pool while the failed refresh still
    stops its engine: resuming then would let requests reach engines in the middle of the sync."""
    pool = await make_pool(num_engines=2)
    later = []

    async def refresh_then_the_loop_pauses():
        await pool.pause()
        later.append(asyncio.ensure_future(pool.pause()))  # the loop's pause, after the refresh's
        raise RuntimeError("transfer broke")

    pool.refresher = refresh_then_the_loop_pauses
    pool.commit_version(3, pool.live_engines())
    pool.engines[0].server.crash()
    assert (await pool.agenerate(_req([1, 2], 3))).stop_reason == StopReason.LENGTH
    for _ in range(300):
        if pool.stats["refresh_failures"]:
            break
        await asyncio.sleep(0.05)
    await asyncio.gather(*later)
    assert pool.stats["refresh_failures"] == 1 and pool.paused  # left for the loop's sync to resume
    await pool.resume()


async def test_requests_fail_at_once_when_no_engine_is_left(make_pool):
    pool = await make_pool(num_engines=1, timeout_s=60.0)
    pool.refresher = lambda: _refresh_that_fails(pool)
    pool.commit_version(1, pool.live_engines())
    pool.engines[0].server.crash()
    resp = await asyncio.wait_for(pool.agenerate(_req([1, 2], 3)), 30)  # not the 60 s request timeout
    assert resp.stop_reason == StopReason.ERROR and "no engine left" in resp.error
    assert pool.stats["refresh_failures"] == 1


async def test_pool_validates_its_inputs(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        EnginePool(RolloutConfig(), tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="num_engines"):
        EnginePool(RolloutConfig(num_engines=0), tmp_path)
    with pytest.raises(Exception, match="not started"):
        await EnginePool(RolloutConfig(), tmp_path).agenerate(_req([1], 1))


async def test_an_engine_restarted_during_a_sync_is_not_marked_as_holding_its_version(make_pool):
    """commit_version matched engines by index only: an engine that crashed and came back while the
    sync ran (its new incarnation holds the model folder's weights) was marked READY."""
    pool = await make_pool(num_engines=2)
    chosen = {e.index: e.incarnation for e in pool.live_engines()}  # what the sync pushed to
    pool.engines[1].incarnation += 1  # restarted meanwhile
    pool.commit_version(1, pool.live_engines(), incarnations=chosen)
    assert [e.state for e in pool.engines] == [EngineState.READY, EngineState.STALE]
    pool.commit_version(2, pool.live_engines())  # no snapshot: the engines as they are now
    assert [e.state for e in pool.engines] == [EngineState.READY, EngineState.READY]

"""AsyncRewardWrapper: process pool, exception / timeout / garbage -> 0.0 counted, recovery, stats."""

import asyncio
import time

import _reward_test_fns as fns
import pytest

from mlrl.reward import GLOBAL_REWARD_STATS, AsyncRewardWrapper, RewardStats, collect_reward_stats


@pytest.fixture(autouse=True, scope="module")
def _shutdown_pools():
    yield
    AsyncRewardWrapper.shutdown_pools()


async def test_runs_in_another_process_and_passes_data():
    import os

    w = AsyncRewardWrapper(fns.worker_pid, max_workers=1, timeout=30)
    pid = await w("p", "c", [1], [2, 3])
    assert pid != float(os.getpid())
    w2 = AsyncRewardWrapper(fns.length_reward, max_workers=1, timeout=30)
    assert await w2("p", "c", [1], [2, 3, 4], answer="x") == 3.0
    assert w2.stats == RewardStats(calls=1, failures=0, timeouts=0)


async def test_exception_gives_zero_and_counts(caplog):
    w = AsyncRewardWrapper(fns.raises, max_workers=1, timeout=30)
    before = GLOBAL_REWARD_STATS.failures
    with collect_reward_stats() as st:
        assert await w("p", "c", [], []) == 0.0
    assert "boom in reward" in caplog.text
    assert w.stats.failures == 1 and st.failures == 1 and st.calls == 1
    assert GLOBAL_REWARD_STATS.failures == before + 1


async def test_non_numeric_return_is_a_failure():
    w = AsyncRewardWrapper(fns.not_a_number, max_workers=1, timeout=30)
    assert await w("p", "c", [], []) == 0.0
    assert w.stats.failures == 1


async def test_timeout_gives_zero_then_pool_recovers_and_inflight_calls_are_retried():
    slow = AsyncRewardWrapper(fns.sleeps, max_workers=2, timeout=0.5)
    medium = AsyncRewardWrapper(fns.sleeps, max_workers=2, timeout=20)
    t0 = time.monotonic()
    # Both land on the same shared pool; the timeout kills that pool while `medium` is running,
    # so `medium` must be retried on the new pool and still return its value.
    r_slow, r_med = await asyncio.gather(slow("p", "c", [], [], seconds=30), medium("p", "c", [], [], seconds=1.0))
    elapsed = time.monotonic() - t0
    assert r_slow == 0.0 and slow.stats.timeouts == 1
    assert r_med == 1.0 and medium.stats.failures == 0 and medium.stats.timeouts == 0
    assert elapsed < 10, "the hung call must not hold the run"
    fast = AsyncRewardWrapper(fns.constant, max_workers=2, timeout=20)
    assert await fast("p", "c", [], [], value=7.0) == 7.0


def test_unpicklable_function_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="cannot be pickled.*max_workers=0"):
        AsyncRewardWrapper(lambda *a, **k: 1.0, max_workers=1)


async def test_thread_mode_accepts_closures_and_keeps_timeouts():
    w = AsyncRewardWrapper(lambda p, c, pi, ci, **d: len(c), max_workers=0, timeout=5)
    assert await w("p", "abcd", [], []) == 4.0
    hung = AsyncRewardWrapper(lambda *a, **k: time.sleep(2) or 1.0, max_workers=0, timeout=0.2)
    assert await hung("p", "c", [], []) == 0.0 and hung.stats.timeouts == 1


async def test_stats_are_attributed_to_the_calling_episode():
    ok = AsyncRewardWrapper(fns.constant, max_workers=1, timeout=30)
    bad = AsyncRewardWrapper(fns.raises, max_workers=1, timeout=30)

    async def episode(w, k):
        with collect_reward_stats() as st:
            for _ in range(k):
                await w("p", "c", [], [])
        return st

    s_ok, s_bad = await asyncio.gather(episode(ok, 3), episode(bad, 2))
    assert (s_ok.calls, s_ok.failures) == (3, 0)
    assert (s_bad.calls, s_bad.failures) == (2, 2)


def test_argument_validation():
    with pytest.raises(ValueError, match="timeout"):
        AsyncRewardWrapper(fns.constant, timeout=0)
    with pytest.raises(TypeError, match="callable"):
        AsyncRewardWrapper("not a function")
    w = AsyncRewardWrapper(fns.constant, timeout_seconds=3.0, max_workers=1)
    assert w.timeout == 3.0 == w.timeout_seconds


@pytest.mark.parametrize("workers", [1, 0])
async def test_score_many_keeps_each_calls_outcome(workers):
    w = AsyncRewardWrapper(fns.by_completion, timeout=5, max_workers=workers)
    # a NaN / inf reward would make its whole group's advantages NaN: a failure scoring 0.0
    calls = [(("p", c, [1], [2]), {"bonus": 0.5}) for c in ("ab", "boom", "text", "nan", "inf", "abcd")]
    with collect_reward_stats() as stats:
        assert await w.score_many(calls) == [2.5, 0.0, 0.0, 0.0, 0.0, 4.5]
    assert (stats.calls, stats.failures, stats.timeouts) == (6, 4, 0)
    assert await w.score_many([]) == []


async def test_score_many_one_pool_round_trip_and_batch_timeout():
    w = AsyncRewardWrapper(fns.worker_pid, timeout=5, max_workers=2)
    pids = await w.score_many([(("p", "c", [1], [2]), {}) for _ in range(8)])
    assert len(set(pids)) == 1  # one task: every call of the batch ran in the same worker
    slow = AsyncRewardWrapper(fns.by_completion, timeout=0.5, max_workers=1)
    with collect_reward_stats() as stats:  # budget 2 x 0.5 s; the hung call takes the batch down
        assert await slow.score_many([(("p", "ok", [], []), {}), (("p", "sleep", [], []), {})]) == [0.0, 0.0]
    assert (stats.calls, stats.timeouts) == (2, 2)
    assert await slow.score_many([(("p", "fine", [], []), {})]) == [4.0]  # the pool was replaced and works


async def test_inline_rewards_run_in_this_process_and_keep_failures_per_call(monkeypatch):
    """register_reward(inline=True) (exact_match, token_match): no pool round trip, same outcomes."""
    import os

    from mlrl.reward import get_reward_fn
    from mlrl.reward.registry import is_inline, register_reward
    from mlrl.reward.wrapper import POOLS

    assert is_inline(get_reward_fn("exact_match")) and is_inline(get_reward_fn("token_match"))
    assert not is_inline(get_reward_fn("gsm8k"))  # math-verify may take long: the pool keeps its timeout

    def boom(*a, **k):
        raise AssertionError("an inline reward must not touch the process pool")

    monkeypatch.setattr(POOLS, "get", boom)
    pid_fn = register_reward("unit_inline_pid", inline=True)(lambda *a, **k: float(os.getpid()))
    assert await AsyncRewardWrapper(pid_fn, max_workers=2)("p", "c", [], []) == float(os.getpid())
    w = AsyncRewardWrapper(get_reward_fn("exact_match"), max_workers=2, timeout=30)
    with collect_reward_stats() as st:
        got = await w.score_many([(("p", "7", [], []), {"answer": "7"}), (("p", "8", [], []), {"answer": "7"}),
                                  (("p", "7", [], []), {})])  # no answer: exact_match raises -> 0.0, a failure
    assert got == [1.0, 0.0, 0.0] and st.calls == 3 and st.failures == 1 and w.stats.failures == 1

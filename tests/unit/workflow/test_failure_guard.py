"""FailureGuard (workflow.max_failure_fraction / max_failure_steps): a step in which every episode
failed stops the run at once; a failure share above the fraction stops it after that many steps
in a row; a good step resets the count; the message carries the first failure's traceback."""

import pytest

from mlrl.workflow.api import EpisodeStatus
from mlrl.workflow.failures import EpisodeFailures, FailureGuard
from mlrl.workflow.runner import EpisodeResult, GroupResult


def _step(failed: int, total: int = 8) -> list[GroupResult]:
    eps = [EpisodeResult(EpisodeStatus.ERROR, info={"error": {
        "error_type": "TypeError", "error_message": "ModelRequest.input_ids: got a list of str",
        "traceback": 'Traceback (most recent call last):\n  File "wf.py", line 3, in arun_episode\nTypeError'}})
        for _ in range(failed)]
    eps += [EpisodeResult(EpisodeStatus.COMPLETED) for _ in range(total - failed)]
    return [GroupResult("g0", {}, eps[: total // 2]), GroupResult("g1", {}, eps[total // 2:])]


def test_every_episode_failed_stops_at_once_with_the_traceback():
    guard = FailureGuard(max_fraction=0.5, max_steps=3)
    with pytest.raises(EpisodeFailures, match=r"step 1: all 8 episodes failed") as e:
        guard.observe(1, _step(8))
    assert "TypeError: ModelRequest.input_ids: got a list of str" in str(e.value)
    assert 'File "wf.py", line 3, in arun_episode' in str(e.value)


def test_a_timeout_counts_as_a_failure():
    guard = FailureGuard(max_fraction=0.5, max_steps=3)
    step = [GroupResult("g", {}, [EpisodeResult(EpisodeStatus.TIMEOUT)] * 4)]
    with pytest.raises(EpisodeFailures, match="timed out"):
        guard.observe(1, step)


@pytest.mark.parametrize("fraction,stops_at", [(0.5, 3), (0.7, None)])
def test_the_fraction_decides_which_failure_share_counts(fraction, stops_at):
    """5 of 8 failed (0.625) every step: above 0.5, so the third step stops the run; below 0.7,
    so a run with that fraction goes on."""
    guard = FailureGuard(max_fraction=fraction, max_steps=3)
    stopped = None
    for step in range(1, 6):
        try:
            guard.observe(step, _step(5))
        except EpisodeFailures as e:
            stopped = step
            assert f"5 of 8 episodes failed, more than workflow.max_failure_fraction={fraction} for 3 steps" in str(e)
            break
    assert stopped == stops_at


@pytest.mark.parametrize("max_steps", [1, 2, 4])
def test_max_steps_is_the_patience(max_steps):
    guard = FailureGuard(max_fraction=0.5, max_steps=max_steps)
    for step in range(1, max_steps):
        guard.observe(step, _step(6))
    with pytest.raises(EpisodeFailures, match=f"for {max_steps} steps in a row"):
        guard.observe(max_steps, _step(6))


def test_a_good_step_resets_the_count_and_an_empty_step_is_ignored():
    guard = FailureGuard(max_fraction=0.5, max_steps=2)
    guard.observe(1, _step(6))
    guard.observe(2, _step(1))   # below the fraction: the streak starts again
    guard.observe(3, _step(6))
    guard.observe(4, [])         # no episodes (nothing to judge)
    with pytest.raises(EpisodeFailures, match="step 5"):
        guard.observe(5, _step(6))


def _scored(reward_fn, n: int) -> list:
    """The stats of n episodes each scoring one completion with the real reward wrapper (in a thread)."""
    import asyncio

    from mlrl.reward import collect_reward_stats
    from mlrl.reward.wrapper import AsyncRewardWrapper

    wrapper = AsyncRewardWrapper(reward_fn, max_workers=0, timeout=5)

    async def one():
        with collect_reward_stats() as stats:
            await wrapper("p", "c", [1], [2], answer="7")
        return stats

    async def main():
        return [await one() for _ in range(n)]

    return asyncio.run(main())


def _bad_reward(prompt, completions, prompt_ids, completion_ids, **data):
    return data["no_such_column"]


def _good_reward(prompt, completions, prompt_ids, completion_ids, **data):
    return 1.0


def test_a_reward_that_fails_on_every_row_stops_the_run():
    """The wrapper scores a raising reward 0.0 and the episode completes: before, the guard saw 8
    completed episodes and the run trained on zeros to its end, exit 0."""
    eps = [EpisodeResult(EpisodeStatus.COMPLETED, reward_stats=st) for st in _scored(_bad_reward, 8)]
    guard = FailureGuard(max_fraction=0.5, max_steps=3)
    with pytest.raises(EpisodeFailures, match=r"step 1: all 8 episodes failed") as e:
        guard.observe(1, [GroupResult("g", {}, eps)])
    assert "all 1 reward calls of the episode failed; the first: reward _bad_reward raised KeyError" in str(e.value)


def test_a_reward_failing_on_some_rows_is_left_to_the_metrics():
    """A judge's unparsed reply is a reward failure scored 0.0, and the signal the policy learns
    from: only a step where nothing was scored stops the run."""
    bad = [EpisodeResult(EpisodeStatus.COMPLETED, reward_stats=st) for st in _scored(_bad_reward, 7)]
    good = [EpisodeResult(EpisodeStatus.COMPLETED, reward_stats=st) for st in _scored(_good_reward, 1)]
    guard = FailureGuard(max_fraction=0.5, max_steps=1)
    for step in range(1, 4):
        guard.observe(step, [GroupResult("g", {}, bad + good)])
    errors = [EpisodeResult(EpisodeStatus.ERROR) for _ in range(4)]  # errors and unscored together: all failed
    with pytest.raises(EpisodeFailures, match="all 8 episodes failed"):
        FailureGuard(max_fraction=0.9, max_steps=3).observe(1, [GroupResult("g", {}, errors + bad[:4])])

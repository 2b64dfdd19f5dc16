"""DAPO dynamic sampling (filter_groups) and overlong reward shaping, by hand."""

import pytest

from mlrl.algorithms.sampling import apply_overlong_shaping, filter_groups, overlong_penalty
from mlrl.types import Sample


def _s(reward, group, n_resp=1):
    n = 1 + n_resp
    return Sample(
        tokens=[0] * n,
        loss_mask=[0] + [1] * n_resp,
        rollout_logprobs=[0.0] * n,
        versions=[-1] + [0] * n_resp,
        reward=reward,
        group_id=group,
    )


def test_filter_groups_drops_flat_groups_and_keeps_order():
    samples = [_s(1, "a"), _s(0, "b"), _s(1, "a"), _s(1, "b"), _s(0, "c"), _s(0, "c"), _s(1, "d")]
    kept, dropped = filter_groups(samples)
    # a = [1, 1] flat, c = [0, 0] flat, d = [1] alone: 3 groups dropped; b = [0, 1] kept
    assert dropped == 3
    assert kept == [samples[1], samples[3]]
    kept, dropped = filter_groups([_s(1.0, "x"), _s(1.05, "x")], atol=0.1)
    assert (kept, dropped) == ([], 1)


def test_overlong_penalty_hand_computed():
    # L_max = 10, buffer 4: start at 6
    # |y| = 6 -> 0 ; 7 -> (6 - 7)/4 = -.25 ; 10 -> -1 ; 12 -> -1.5 clipped to -1
    assert [overlong_penalty(n, 10, 4) for n in (3, 6, 7, 10, 12)] == pytest.approx([0, 0, -0.25, -1.0, -1.0])
    # penalty .5 caps earlier: 9 -> -.75 -> -.5 ; 7 -> -.25
    assert overlong_penalty(9, 10, 4, penalty=0.5) == pytest.approx(-0.5)
    assert overlong_penalty(7, 10, 4, penalty=0.5) == pytest.approx(-0.25)
    assert overlong_penalty(10, 10, 0) == 0.0  # buffer 0 = off
    with pytest.raises(ValueError, match="buffer=11"):
        overlong_penalty(5, 10, 11)


def test_apply_overlong_shaping_uses_policy_token_count():
    samples = [_s(1.0, "a", n_resp=5), _s(1.0, "a", n_resp=8), _s(0.0, "a", n_resp=9)]
    # L_max 10, buffer 4: 5 -> 0 ; 8 -> -.5 ; 9 -> -.75
    assert apply_overlong_shaping(samples, 10, 4) == 2
    assert [s.reward for s in samples] == pytest.approx([1.0, 0.5, -0.75])
    assert samples[1].metadata["overlong_penalty"] == pytest.approx(-0.5)
    # what the workflow scored stays readable: the rollout metrics report it, shaped or not, in any round
    assert [s.task_reward for s in samples] == pytest.approx([1.0, 1.0, 0.0])


def test_rollout_metrics_report_the_task_reward_after_shaping():
    from mlrl.types import EpisodeStatus
    from mlrl.workflow.runner import EpisodeResult, GroupResult, summarize

    samples = [_s(1.0, "a", n_resp=5), _s(1.0, "a", n_resp=10)]
    episodes = [EpisodeResult(EpisodeStatus.COMPLETED, [x]) for x in samples]
    before = summarize([GroupResult("a", {}, episodes)])
    apply_overlong_shaping(samples, 10, 4)   # the second sample: reward 1.0 - 1.0, no longer "> 0"
    after = summarize([GroupResult("a", {}, episodes)])
    assert before["reward/mean"] == after["reward/mean"] == 1.0 and after["reward/accuracy"] == 1.0


def test_filter_groups_compares_the_task_reward_not_the_length_shaped_one():
    """Four correct answers, one inside the overlong buffer: shaped rewards [1, 1, 1, .875] differ,
    but the group says nothing about the task (DAPO keeps 0 < |correct| < G; verl's recipe
    filters on acc). Before, it was kept and GRPO gave it advantages [.5, .5, .5, -1.5]."""
    group = [_s(1.0, "a", n_resp=n) for n in (20, 30, 40, 50)]
    assert apply_overlong_shaping(group, 64, 16) == 1
    assert [s.reward for s in group] == pytest.approx([1, 1, 1, 0.875])
    assert filter_groups(group) == ([], 1)
    mixed = [_s(1.0, "b", n_resp=20), _s(0.0, "b", n_resp=50)]  # a real correctness spread stays
    apply_overlong_shaping(mixed, 64, 16)
    assert filter_groups(mixed) == (mixed, 0)


def _turns(*lengths):
    """A multi-turn sample: a prompt token, then each turn's policy tokens after 3 masked tool tokens."""
    mask = [0]
    for n in lengths:
        mask += [0, 0, 0] + [1] * n
    return Sample(tokens=[0] * len(mask), loss_mask=mask, rollout_logprobs=[0.0] * len(mask),
                  versions=[0 if m else -1 for m in mask], reward=1.0, group_id="t")


def test_overlong_shaping_measures_the_longest_turn_of_a_multi_turn_sample():
    """max_new_tokens limits each request: three 30-token turns under a 64-token limit were
    penalised -1.0 for their 90 tokens in all; now only a turn inside the buffer is penalised."""
    from mlrl.algorithms.sampling import longest_generation

    three, long_one = _turns(30, 30, 30), _turns(10, 60, 5)
    assert (longest_generation(three), longest_generation(long_one)) == (30, 60)
    assert apply_overlong_shaping([three, long_one], 64, 16) == 1
    assert three.reward == 1.0 and long_one.reward == pytest.approx(1.0 + (48 - 60) / 16)

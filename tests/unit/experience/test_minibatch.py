"""Mini-batches hold whole prompt groups, dealt evenly in order of first appearance."""

import pytest

from mlrl.experience.minibatch import split_groups
from mlrl.types import Sample


def _samples(groups):
    return [
        Sample(tokens=[1, 2], loss_mask=[0, 1], rollout_logprobs=[0.0, -1.0], versions=[0, 0], group_id=g)
        for g in groups
    ]


def test_whole_groups_evenly():
    s = _samples(["a", "a", "b", "b", "c", "c", "d", "d"])
    assert split_groups(s, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_groups(s, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_groups(s, 1) == [list(range(8))]


def test_interleaved_groups_stay_together_and_uneven_counts_differ_by_one_group():
    s = _samples(["a", "b", "a", "c", "b", "c", "d"])
    parts = split_groups(s, 3)
    assert parts == [[0, 1, 2, 4], [3, 5], [6]]
    assert sorted(i for p in parts for i in p) == list(range(7))
    assert split_groups(s, 10) == [[0, 2], [1, 4], [3, 5], [6]]  # never an empty mini-batch
    with pytest.raises(ValueError, match="mini_batches_per_step=0"):
        split_groups(s, 0)

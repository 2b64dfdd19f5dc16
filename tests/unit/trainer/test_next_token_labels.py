"""The vectorised label layout of a packed row equals the per-sample definition."""

import random

import torch

from mlrl.trainer.rank.inputs import next_token_labels


def _per_sample(tokens: torch.Tensor, cu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.zeros(tokens.numel(), dtype=torch.int64)
    mask = torch.zeros(tokens.numel(), dtype=torch.bool)
    for a, b in zip(cu, cu[1:]):
        if b - a > 1:
            labels[a:b - 1] = tokens[a + 1:b]
            mask[a:b - 1] = True
    return labels, mask


def test_matches_the_per_sample_definition_on_random_rows():
    rng = random.Random(0)
    for _ in range(300):
        lens = [rng.choice([0, 1, 2, 3, 9]) for _ in range(rng.randint(0, 8))]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        tokens = torch.randint(1, 100, (cu[-1] + rng.randint(0, 3),))  # + a padding tail
        want, got = _per_sample(tokens, cu), next_token_labels(tokens, cu)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), cu


def test_last_token_of_each_sample_and_padding_have_no_label():
    tokens = torch.tensor([5, 6, 7, 8, 9, 0, 0])
    labels, mask = next_token_labels(tokens, [0, 3, 5])
    assert labels.tolist() == [6, 7, 0, 9, 0, 0, 0]
    assert mask.tolist() == [True, True, False, True, False, False, False]

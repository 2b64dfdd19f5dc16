"""The reward model's Bradley-Terry loss on packed micro-batches: a sequence's score is the per-position
score at its LAST token (nothing else is read), the loss and gradients equal the per-pair formula
whatever the split into micro-batches and DP ranks, the centring knob pulls the scores toward 0 as
theory says, and broken micro-batches are refused."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.preference_pairs import random_pairs

from mlrl.algorithms.loss_metrics import combine_loss_metrics, finalize_loss_metrics
from mlrl.algorithms.rm_loss import make_rm_loss_fn, sequence_scores
from mlrl.experience.packing import gather_per_sample, pack_step
from mlrl.jobs.dpo import pack_pairs, samples_of


def _position_scores(pairs, seed: int) -> list[torch.Tensor]:
    """Per-sample per-position scores: noise everywhere, so reading any other position than the last
    would change the loss."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(len(p[s][0]), generator=g) * 2 for p in pairs for s in ("chosen", "rejected")]


def _formula(scores, center):
    last = torch.stack([s[-1] for s in scores])
    rc, rr = last[0::2], last[1::2]
    return (-F.logsigmoid(rc - rr) + center * (rc + rr) ** 2).mean()


def _packed_loss(pairs, scores, center, dp, budget):
    per_dp, _ = pack_pairs(pairs, dp, budget)
    fn = make_rm_loss_fn(center)
    total, parts, n_mb = 0.0, [], 0
    for rank in per_dp:
        for mb in rank:
            n_mb += 1
            s = gather_per_sample(mb, scores) if mb.num_samples else torch.zeros(mb.num_tokens)
            loss, metrics = fn(mb, s)
            total = total + loss
            parts.append({"loss": loss.detach(), **metrics})
    return total, finalize_loss_metrics(combine_loss_metrics(parts)), n_mb


@pytest.mark.parametrize("center", [0.0, 0.05])
def test_loss_and_grads_are_the_formula_whatever_the_split(center):
    pairs = random_pairs(7)
    want_s = [t.clone().requires_grad_() for t in _position_scores(pairs, 2)]
    want = _formula(want_s, center)
    want.backward()
    for dp, budget in ((1, 256), (2, 24), (3, 22)):
        s = [t.clone().detach().requires_grad_() for t in _position_scores(pairs, 2)]
        got, metrics, n_mb = _packed_loss(pairs, s, center, dp, budget)
        got.backward()
        want_loss = float(want.detach())
        assert abs(float(got.detach()) - want_loss) < 1e-6 and abs(metrics["loss"] - want_loss) < 1e-6
        for a, b in zip(s, want_s):
            assert torch.allclose(a.grad, b.grad, atol=1e-7)
            assert bool((a.grad[:-1] == 0).all())  # only the last position's score is read
        assert metrics["n_pairs"] == 7
        last = [float(t[-1].detach()) for t in s]
        assert metrics["chosen_score"] == pytest.approx(sum(last[0::2]) / 7, abs=1e-6)
        assert metrics["pair_accuracy"] == pytest.approx(sum(float(a > b) for a, b in zip(last[0::2], last[1::2])) / 7)
        if budget < 256:
            assert n_mb > 2


def test_equal_scores_give_log_2_and_the_gradient_raises_chosen_and_lowers_rejected():
    pairs = random_pairs(2, seed=3)
    scores = [torch.zeros(len(p[s][0]), requires_grad=True) for p in pairs for s in ("chosen", "rejected")]
    loss, m, _ = _packed_loss(pairs, scores, 0.0, 1, 256)
    assert float(loss.detach()) == pytest.approx(math.log(2)) and m["score_margin"] == 0 and m["pair_accuracy"] == 0
    loss.backward()
    assert all(float(s.grad[-1]) < 0 for s in scores[0::2])  # descent raises the chosen scores
    assert all(float(s.grad[-1]) > 0 for s in scores[1::2])  # and lowers the rejected ones


def test_centring_pulls_the_scores_toward_zero_and_leaves_the_margin():
    """Both sides scored high (same margin): the centring term adds (r_w + r_l)^2 and its gradient
    pushes both scores down; without it the pairwise loss is blind to a common shift."""
    pairs = random_pairs(1, seed=5)
    results = {}
    for center in (0.0, 0.1):
        scores = [torch.full((len(pairs[0][s][0]),), v, requires_grad=True)
                  for s, v in (("chosen", 3.0), ("rejected", 2.0))]
        loss, m, _ = _packed_loss(pairs, scores, center, 1, 256)
        loss.backward()
        results[center] = (float(loss.detach()), float(scores[0].grad[-1] + scores[1].grad[-1]), m["score_margin"])
    (l0, g0, m0), (l1, g1, m1) = results[0.0], results[0.1]
    assert g0 == pytest.approx(0.0, abs=1e-7)  # pairwise only: no pull on the mean
    assert g1 > 0.5  # centred: descent lowers both (d/dr of 0.1 * (3 + 2)^2 = 1.0 each, summed 2.0)
    assert l1 == pytest.approx(l0 + 0.1 * 25) and m0 == m1 == pytest.approx(1.0)


def test_sequence_scores_read_each_segments_last_position():
    pairs = random_pairs(3, seed=1)
    per_dp, _ = pack_pairs(pairs, 1, 256)
    mb = per_dp[0][0]
    positions = torch.arange(mb.num_tokens, dtype=torch.float32)
    ends = mb.cu_seqlens[1:].long() - 1
    assert sequence_scores(mb, positions).tolist() == ends.float().tolist()


def test_a_padding_only_micro_batch_reports_every_key():
    pairs = random_pairs(3)
    per_dp, _ = pack_pairs(pairs, 2, 20)
    fn = make_rm_loss_fn(0.0)
    keys = []
    for rank in per_dp:
        for mb in rank:
            s = gather_per_sample(mb, _position_scores(pairs, 2)) if mb.num_samples else torch.zeros(mb.num_tokens)
            keys.append((mb.num_samples, sorted(fn(mb, s)[1])))
    assert any(n == 0 for n, _ in keys) and any(n > 0 for n, _ in keys)
    assert len({tuple(k) for _, k in keys}) == 1, keys


def test_bad_settings_and_broken_micro_batches_are_refused():
    with pytest.raises(ValueError, match="rm.center_rewards_coefficient=-1"):
        make_rm_loss_fn(-1.0)
    pairs = random_pairs(2)
    fn = make_rm_loss_fn(0.0)
    one_side, _ = pack_step(samples_of(pairs)[:3], dp_size=1, token_budget=256, loss_agg="seq-mean-token-sum")
    mb = one_side[0][0]
    with pytest.raises(ValueError, match="whole .chosen, rejected. pairs"):
        fn(mb, torch.zeros(mb.num_tokens))
    per_dp, _ = pack_pairs(pairs, 1, 256)
    mb = per_dp[0][0]
    mb.loss_mask[:] = 0
    with pytest.raises(ValueError, match="without completion tokens"):
        fn(mb, torch.zeros(mb.num_tokens))

"""The DPO / IPO loss on packed micro-batches: equal to the per-pair formula, whatever the split into
micro-batches and DP ranks (loss and gradients), pairs packed whole, the knobs (beta, loss_type)
move the loss the way theory says, and broken micro-batches are refused."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.preference_pairs import random_pairs

from mlrl.algorithms.dpo_loss import make_dpo_loss_fn
from mlrl.algorithms.loss_metrics import combine_loss_metrics, finalize_loss_metrics
from mlrl.experience.packing import attach_per_sample, gather_per_sample, pack_step
from mlrl.jobs.dpo import pack_pairs, samples_of


def _token_logprobs(pairs, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [-torch.rand(len(p[s][0]), generator=g, dtype=torch.float64).float() * 3 for p in pairs
            for s in ("chosen", "rejected")]


def _formula(pairs, pol, ref, beta, loss_type):
    losses = []
    for k, p in enumerate(pairs):
        r = []
        for j, s in enumerate(("chosen", "rejected")):
            m = torch.tensor(p[s][1], dtype=torch.float32)
            a, b = (pol[2 * k + j] * m).sum(), (ref[2 * k + j] * m).sum()
            if loss_type == "ipo":
                a, b = a / m.sum(), b / m.sum()
            r.append(a - b)
        h = r[0] - r[1]
        losses.append(-F.logsigmoid(beta * h) if loss_type == "sigmoid" else (h - 1 / (2 * beta)) ** 2)
    return torch.stack(losses).mean()


def _packed_loss(pairs, pol, ref, beta, loss_type, dp, budget):
    per_dp, _ = pack_pairs(pairs, dp, budget)
    fn = make_dpo_loss_fn(beta, loss_type)
    total, parts, n_mb = 0.0, [], 0
    for rank in per_dp:
        attach_per_sample(rank, "ref_logprobs", ref)
        for mb in rank:
            n_mb += 1
            lp = gather_per_sample(mb, pol) if mb.num_samples else torch.zeros(mb.num_tokens)
            loss, metrics = fn(mb, lp, torch.zeros(mb.num_tokens))
            total = total + loss
            parts.append({"loss": loss.detach(), **metrics})
    return total, finalize_loss_metrics(combine_loss_metrics(parts)), n_mb


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_loss_and_grads_are_the_formula_whatever_the_split(loss_type):
    pairs = random_pairs(7)
    ref = _token_logprobs(pairs, 1)
    want_pol = [t.clone().requires_grad_() for t in _token_logprobs(pairs, 2)]
    want = _formula(pairs, want_pol, ref, 0.3, loss_type)
    want.backward()
    for dp, budget in ((1, 256), (2, 24), (3, 22)):
        pol = [t.clone().detach().requires_grad_() for t in _token_logprobs(pairs, 2)]
        got, metrics, n_mb = _packed_loss(pairs, pol, ref, 0.3, loss_type, dp, budget)
        got.backward()
        want_loss = float(want.detach())
        assert abs(float(got.detach()) - want_loss) < 1e-6 and abs(metrics["loss"] - want_loss) < 1e-6
        for a, b in zip(pol, want_pol):
            assert torch.allclose(a.grad, b.grad, atol=1e-7)
        assert metrics["n_pairs"] == 7
        if budget < 256:
            assert n_mb > 2


def test_a_padding_only_micro_batch_reports_every_key():
    """A DP rank with fewer pairs gets padding-only micro-batches: they report the same keys (at 0) as
    a real one, so the trainer reduces one key set over micro-batches and DP ranks (a missing key was
    a KeyError in its reduction)."""
    pairs = random_pairs(3)
    per_dp, _ = pack_pairs(pairs, 2, 20)  # rank 0: one pair, then padding; rank 1: two micro-batches of a pair
    ref = _token_logprobs(pairs, 1)
    fn = make_dpo_loss_fn(0.1, "sigmoid")
    keys = []
    for rank in per_dp:
        attach_per_sample(rank, "ref_logprobs", ref)
        for mb in rank:
            lp = gather_per_sample(mb, _token_logprobs(pairs, 2)) if mb.num_samples else torch.zeros(mb.num_tokens)
            keys.append((mb.num_samples, sorted(fn(mb, lp, torch.zeros(mb.num_tokens))[1])))
    assert any(n == 0 for n, _ in keys) and any(n > 0 for n, _ in keys)  # both kinds were packed
    assert len({tuple(k) for _, k in keys}) == 1, keys


def test_pairs_are_packed_whole_and_in_order():
    pairs = random_pairs(9, seed=4)
    per_dp, _ = pack_pairs(pairs, 2, 20)
    seen = []
    for rank in per_dp:
        for mb in rank:
            ids = mb.sample_ids[mb.cu_seqlens[:-1].long()].tolist() if mb.num_samples else []
            assert ids[0::2] == [i - 1 for i in ids[1::2]] and all(i % 2 == 0 for i in ids[0::2])
            seen += ids
    assert sorted(seen) == list(range(18))
    with pytest.raises(ValueError, match="must be packed whole"):
        pack_pairs(pairs, 1, 11)  # every sample fits 11 tokens, not every pair


def test_packing_needs_group_ids_and_no_shared_prefix():
    samples = samples_of(random_pairs(2))
    with pytest.raises(ValueError, match="cannot be combined"):
        pack_step(samples, dp_size=1, token_budget=64, loss_agg="seq-mean-token-sum", whole_groups=True,
                  shared_prefix=True)
    samples[1].group_id = ""
    with pytest.raises(ValueError, match=r"samples\[1\] has no group_id"):
        pack_step(samples, dp_size=1, token_budget=64, loss_agg="seq-mean-token-sum", whole_groups=True)


def _loss(beta, loss_type, shift):
    """One pair where the policy prefers chosen by `shift` nats over the reference."""
    pairs = [{"chosen": ([5, 6, 7], [0, 1, 1]), "rejected": ([5, 8], [0, 1])}]
    ref = [torch.tensor([0.0, -1.0, -1.0]), torch.tensor([0.0, -1.0])]
    pol = [ref[0] + torch.tensor([0.0, shift, 0.0]), ref[1].clone()]
    return _packed_loss(pairs, pol, ref, beta, loss_type, 1, 64)[:2]


def test_at_the_reference_the_dpo_loss_is_log_2():
    loss, m = _loss(0.1, "sigmoid", 0.0)
    assert abs(float(loss) - math.log(2)) < 1e-7 and m["reward_margin"] == 0 and m["reward_accuracy"] == 0


def test_beta_scales_the_implicit_reward_and_lowers_the_loss_of_a_preferred_pair():
    (lo, m_lo), (hi, m_hi) = _loss(0.1, "sigmoid", 1.0), _loss(1.0, "sigmoid", 1.0)
    assert float(hi) < float(lo) < math.log(2)
    assert m_lo["reward_margin"] == pytest.approx(0.1) and m_hi["reward_margin"] == pytest.approx(1.0)
    assert m_lo["reward_accuracy"] == m_hi["reward_accuracy"] == 1.0
    assert m_hi["chosen_reward"] == pytest.approx(1.0) and m_hi["rejected_reward"] == 0.0


def test_ipo_targets_a_margin_of_one_over_two_beta():
    # IPO on per-token means: a shift of 1 nat on one of 2 chosen tokens is h = 0.5 = 1 / (2 * 1.0)
    assert float(_loss(1.0, "ipo", 1.0)[0]) == pytest.approx(0.0, abs=1e-12)
    assert float(_loss(0.5, "ipo", 1.0)[0]) == pytest.approx(0.25)  # target 1, h 0.5
    assert float(_loss(1.0, "sigmoid", 1.0)[0]) != pytest.approx(float(_loss(1.0, "ipo", 1.0)[0]))


def test_bad_settings_and_broken_micro_batches_are_refused():
    with pytest.raises(ValueError, match="dpo.beta=0"):
        make_dpo_loss_fn(0.0, "sigmoid")
    with pytest.raises(ValueError, match="dpo.loss_type='hinge'"):
        make_dpo_loss_fn(0.1, "hinge")
    pairs = random_pairs(2)
    per_dp, _ = pack_pairs(pairs, 1, 256)
    mb = per_dp[0][0]
    fn = make_dpo_loss_fn(0.1, "sigmoid")
    with pytest.raises(ValueError, match="needs the reference's logprobs"):
        fn(mb, torch.zeros(mb.num_tokens), torch.zeros(mb.num_tokens))
    one_side, _ = pack_step(samples_of(pairs)[:3], dp_size=1, token_budget=256, loss_agg="seq-mean-token-sum")
    mb = one_side[0][0]
    mb.ref_logprobs = torch.zeros(mb.num_tokens)
    with pytest.raises(ValueError, match="whole .chosen, rejected. pairs"):
        fn(mb, torch.zeros(mb.num_tokens), torch.zeros(mb.num_tokens))

"""Policy losses, KL estimators, aggregation weights and make_loss_fn against hand-worked values."""

import math

import pytest
import torch

from mlrl.algorithms.kl import kl_estimate
from mlrl.algorithms.loss_metrics import combine_loss_metrics, finalize_loss_metrics, metric_reduction
from mlrl.algorithms.losses import gspo_loss, loss_agg_weights, make_loss_fn, ppo_clip_loss
from mlrl.algorithms.segments import segment_index
from mlrl.config.schema import AlgorithmConfig
from mlrl.experience.batch import MicroBatch

LN = math.log


def leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def close(t, values, tol=1e-6):
    assert torch.allclose(t.detach().to(torch.float64), torch.tensor(values, dtype=torch.float64), atol=tol), (
        t.tolist(),
        values,
    )


def test_ppo_clip_hand_computed():
    # old = 0, so ratio = exp(logp); eps = .2; the last token is masked and holds garbage
    # t0 r=1.5 A=+1: max(-1.5, -1.2) = -1.2 (clipped, grad 0)
    # t1 r=0.5 A=+1: max(-0.5, -0.8) = -0.5 (grad -A r = -0.5)
    # t2 r=1.1 A=-1: max( 1.1,  1.1) =  1.1 (grad -A r = 1.1)
    # t3 r=0.7 A=-1: max( 0.7,  0.8) =  0.8 (clipped, grad 0)
    lp = leaf([LN(1.5), LN(0.5), LN(1.1), LN(0.7), 1e4])
    out = ppo_clip_loss(
        lp,
        torch.zeros(5, dtype=torch.float64),
        torch.tensor([1.0, 1, -1, -1, 5]),
        torch.tensor([1, 1, 1, 1, 0]),
        eps_low=0.2,
    )
    close(out.loss, [-1.2, -0.5, 1.1, 0.8, 0])
    close(out.clipped, [1, 0, 0, 1, 0])
    close(out.ratio, [1.5, 0.5, 1.1, 0.7, 0])
    out.loss.sum().backward()
    close(lp.grad, [0, -0.5, 1.1, 0, 0])


def test_clip_higher_is_asymmetric():
    # eps_low .2, eps_high .28: r=1.5 A=+1 -> -1.28 ; r=.7 A=-1 -> still clipped at .8
    out = ppo_clip_loss(
        leaf([LN(1.5), LN(0.7)]),
        torch.zeros(2, dtype=torch.float64),
        torch.tensor([1.0, -1.0]),
        torch.ones(2),
        0.2,
        0.28,
    )
    close(out.loss, [-1.28, 0.8])


def test_dual_clip_hand_computed():
    # c = 3:
    # t0 r=4   A=-1: ppo max(4, 1.2) = 4 -> min(4, 3) = 3 (dual active, grad 0)
    # t1 r=2.5 A=-1: ppo 2.5 < 3 -> 2.5 (grad -A r = 2.5)
    # t2 r=4   A=+1: dual-clip does not apply: max(-4, -1.2) = -1.2
    lp = leaf([LN(4.0), LN(2.5), LN(4.0)])
    out = ppo_clip_loss(
        lp, torch.zeros(3, dtype=torch.float64), torch.tensor([-1.0, -1.0, 1.0]), torch.ones(3), 0.2, dual_clip_c=3.0
    )
    close(out.loss, [3.0, 2.5, -1.2])
    close(out.dual_clipped, [1, 0, 0])
    out.loss.sum().backward()
    close(lp.grad, [0, 2.5, 0])
    with pytest.raises(ValueError, match="dual_clip_c=1.0: expected > 1"):
        ppo_clip_loss(lp, torch.zeros(3), torch.ones(3), torch.ones(3), dual_clip_c=1.0)


def test_gspo_sequence_ratio_hand_computed():
    # packed row: seq0 = positions 0..2 (mask 0,1,1), seq1 = 3..4 (mask 0,1), one padding slot
    # logp - old: seq0 (.2, .4) -> s0 = exp(.3) = 1.349859 ; seq1 (-.1) -> s1 = exp(-.1) = .904837
    # eps .2: seq0 A=+1 clipped at 1.2 -> -1.2 per token (grad 0); seq1 A=-1 unclipped -> +.904837
    #   with grad -A * s1 = .904837
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    seg = segment_index(cu, 6)
    assert seg.tolist() == [0, 0, 0, 1, 1, 2]
    mask = torch.tensor([0, 1, 1, 0, 1, 0])
    lp = leaf([0.0, 0.2, 0.4, 0.0, -0.1, 7.0])
    adv = torch.tensor([0.0, 1, 1, 0, -1, 0])
    out = gspo_loss(lp, torch.zeros(6, dtype=torch.float64), adv, mask, seg, 2, 0.2)
    close(out.ratio, [0, 1.349859, 1.349859, 0, 0.904837, 0])
    close(out.loss, [0, -1.2, -1.2, 0, 0.904837, 0])
    out.loss.sum().backward()
    close(lp.grad, [0, 0, 0, 0, 0.904837, 0])


def test_gspo_gradient_matches_paper_with_seq_mean_token_mean():
    # unclipped (eps .5): paper loss -A * exp(mean_t(logp - old)); d/dlogp_t = -A * s / |y|
    # s = exp(.3) = 1.349859, |y| = 2, A = 1 -> each token -0.674929
    seg = segment_index(torch.tensor([0, 3], dtype=torch.int32), 3)
    lp = leaf([0.0, 0.2, 0.4])
    out = gspo_loss(
        lp, torch.zeros(3, dtype=torch.float64), torch.tensor([0.0, 1, 1]), torch.tensor([0, 1, 1]), seg, 1, 0.5
    )
    (out.loss.sum() / 2).backward()
    close(lp.grad, [0, -0.674929, -0.674929])


def test_kl_estimators_hand_computed():
    # logp = ln .5, ref = ln .25: d = ln 2 = .693147
    # k1 = .693147 ; k2 = d^2/2 = .240227 ; k3 = exp(-d) - 1 + d = .5 - 1 + .693147 = .193147
    lp = leaf([LN(0.5)])
    ref = torch.tensor([LN(0.25)], dtype=torch.float64)
    close(kl_estimate(lp, ref, "k1"), [0.693147])
    close(kl_estimate(lp, ref, "k2"), [0.240227])
    k3 = kl_estimate(lp, ref, "k3")
    close(k3, [0.193147])
    k3.sum().backward()  # d k3 / d logp = 1 - exp(-d) = .5
    close(lp.grad, [0.5])
    with pytest.raises(ValueError, match="kl estimator 'k4'"):
        kl_estimate(lp, ref, "k4")


def test_loss_agg_weights_hand_computed():
    # loss tokens per sample: 2, 1, 0, 3 -> n = 3 samples with tokens, 6 tokens
    counts = [2, 1, 0, 3]
    assert loss_agg_weights(counts, "token-mean") == pytest.approx([1 / 6, 1 / 6, 0, 1 / 6])
    assert loss_agg_weights(counts, "seq-mean-token-mean") == pytest.approx([1 / 6, 1 / 3, 0, 1 / 9])
    assert loss_agg_weights(counts, "seq-mean-token-sum") == pytest.approx([1 / 3, 1 / 3, 0, 1 / 3])
    assert loss_agg_weights(counts, "seq-mean-token-sum-norm", norm_len=4) == pytest.approx([1 / 12, 1 / 12, 0, 1 / 12])
    assert loss_agg_weights(counts, "seq-mean-token-sum-norm") == pytest.approx([1 / 9, 1 / 9, 0, 1 / 9])
    assert loss_agg_weights([0, 0], "token-mean") == [0.0, 0.0]
    with pytest.raises(ValueError, match="algorithm.loss_agg='mean'"):
        loss_agg_weights(counts, "mean")


def _mb(adv, weight, mask, rollout=None, ref=None):
    """One-sample micro-batch with old logprobs 0."""
    s = len(mask)
    return MicroBatch(
        tokens=torch.arange(s),
        position_ids=torch.arange(s),
        cu_seqlens=torch.tensor([0, s], dtype=torch.int32),
        sample_ids=torch.zeros(s, dtype=torch.int64),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        loss_weight=torch.tensor(weight, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        rollout_logprobs=torch.tensor(rollout if rollout is not None else [0.0] * s),
        old_logprobs=torch.zeros(s),
        ref_logprobs=None if ref is None else torch.tensor(ref, dtype=torch.float32),
    )


def test_make_loss_fn_hand_computed():
    # one sample, mask [0,1,1,1], token-mean weights 1/3, A = 1, old = 0, ratios 1.5, .5, 1.1:
    #   pg = [-1.2, -.5, -1.1] -> mean -.933333 ; clipfrac 1/3 ; ratio mean 1.033333, max 1.5, min .5
    # ref = logp - ln 2 -> k3 = .193147 per token, kl_coef .1 -> +.019315
    # entropy [_, 1, 2, 3], coef .01 -> -.02
    # total = -.933333 + .019315 - .02 = -.934019
    lp_vals = [0.0, LN(1.5), LN(0.5), LN(1.1)]
    ref = [v - LN(2) for v in lp_vals]
    ref[0] = 0.0
    w = [0, 1 / 3, 1 / 3, 1 / 3]
    mb = _mb([0, 1, 1, 1], w, [0, 1, 1, 1], ref=ref)
    cfg = AlgorithmConfig(policy_loss="ppo", eps_clip=0.2, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    lp = torch.tensor(lp_vals, requires_grad=True)
    loss, m = make_loss_fn(cfg)(mb, lp, torch.tensor([0.0, 1, 2, 3]))
    assert float(loss.detach()) == pytest.approx(-0.934019, abs=1e-5)
    f = finalize_loss_metrics(combine_loss_metrics([m]))
    assert f["pg_loss"] == pytest.approx(-0.933333, abs=1e-5)
    assert f["kl_loss"] == pytest.approx(0.019315, abs=1e-5)
    assert f["entropy_loss"] == pytest.approx(-0.02, abs=1e-6)
    assert f["clip_fraction"] == pytest.approx(1 / 3)
    assert f["kl"] == pytest.approx(0.193147, abs=1e-5)
    assert f["entropy"] == pytest.approx(2.0)
    assert f["ratio_mean"] == pytest.approx(1.033333, abs=1e-5)
    assert (f["ratio_max"], f["ratio_min"]) == pytest.approx((1.5, 0.5))
    assert (f["n_tokens"], f["n_seqs"]) == (3.0, 1.0)
    loss.backward()
    # grads: pg (t1 clipped: 0; t2: -r/3 = -.166667; t3: -1.1/3 = -.366667) + kl .1 * (1 - exp(-ln2)) / 3 = .016667
    close(lp.grad, [0, 0.016667, -0.166667 + 0.016667, -0.366667 + 0.016667], tol=1e-5)


def test_make_loss_fn_applies_tis_weight_to_policy_term():
    # old = 0, rollout = -ln 3 -> rho = 3, TIS cap 2 -> w = 2 ; logp = old -> ratio 1, A = 1 -> pg = -1
    # loss = w * pg * weight(=1) = -2 ; gradient -A * r * w = -2
    mb = _mb([1.0], [1.0], [1], rollout=[-LN(3)])
    lp = torch.zeros(1, requires_grad=True)
    loss, m = make_loss_fn(AlgorithmConfig(rollout_is="tis", rollout_is_cap=2.0))(mb, lp, None)
    assert float(loss.detach()) == pytest.approx(-2.0)
    loss.backward()
    assert float(lp.grad[0]) == pytest.approx(-2.0)
    assert float(m["mismatch/clipped_frac"]) == 1.0
    # MIS token: rho = 3 is outside [1/2, 2] -> the token is masked: loss 0, gradient 0
    lp = torch.zeros(1, requires_grad=True)
    loss, m = make_loss_fn(AlgorithmConfig(rollout_is="mis_token", rollout_is_cap=2.0))(mb, lp, None)
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(lp.grad[0]) == 0.0
    assert float(m["mismatch/masked_frac"]) == 1.0


def test_make_loss_fn_errors_name_what_is_missing():
    mb = _mb([0, 1], [0, 1], [0, 1])
    with pytest.raises(ValueError, match="needs mb.ref_logprobs"):
        make_loss_fn(AlgorithmConfig(kl_coef=0.1))(mb, torch.zeros(2), None)
    with pytest.raises(ValueError, match="entropy_coef > 0 needs"):
        make_loss_fn(AlgorithmConfig(entropy_coef=0.1))(mb, torch.zeros(2), None)
    with pytest.raises(ValueError, match=r"logprobs has shape \(3,\), expected \(2,\)"):
        make_loss_fn(AlgorithmConfig())(mb, torch.zeros(3), None)
    cfg = AlgorithmConfig()
    cfg.policy_loss = "trpo"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="algorithm.policy_loss='trpo'"):
        make_loss_fn(cfg)
    # KL in the reward: no reference needed by the loss
    loss, _ = make_loss_fn(AlgorithmConfig(kl_coef=0.1, kl_in_reward=True))(mb, torch.zeros(2), None)
    assert float(loss.detach()) == pytest.approx(-1.0)


def test_metric_reductions():
    assert [metric_reduction(k) for k in ("kl", "ratio_max", "ratio_min")] == ["sum", "max", "min"]
    a = {
        "kl": torch.tensor(1.0),
        "n_tokens": torch.tensor(2.0),
        "ratio_max": torch.tensor(1.5),
        "ratio_min": torch.tensor(float("inf")),
    }
    b = {
        "kl": torch.tensor(2.0),
        "n_tokens": torch.tensor(4.0),
        "ratio_max": torch.tensor(1.2),
        "ratio_min": torch.tensor(0.9),
    }
    f = finalize_loss_metrics(combine_loss_metrics([a, b]))
    assert f == pytest.approx({"kl": 0.5, "n_tokens": 6.0, "ratio_max": 1.5, "ratio_min": 0.9})

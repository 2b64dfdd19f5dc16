"""The step loss and its gradient do not depend on how the step is split into micro-batches and DP
ranks (the MicroBatch contract): the same samples packed with different token budgets, DP sizes
and padding give the same summed loss, the same gradient w.r.t. per-sample logprob leaves and
the same step metrics; and the sum equals the aggregation computed directly on unpacked samples."""

import itertools

import pytest
import torch

from mlrl.algorithms.loss_metrics import combine_loss_metrics, finalize_loss_metrics
from mlrl.algorithms.losses import make_loss_fn, ppo_clip_loss
from mlrl.config.schema import AlgorithmConfig
from mlrl.experience.packing import attach_per_sample, gather_per_sample, pack_step
from mlrl.types import Sample

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
SPLITS = [  # (dp_size, token_budget, pad_multiple)
    (1, 256, 1),
    (1, 16, 1),
    (2, 24, 4),
    (3, 16, 8),
    (4, 32, 2),
]
NORM_LEN = 20


def _step():
    g = torch.Generator().manual_seed(0)
    samples, old, ref, lp0, ent0 = [], [], [], [], []
    for i in range(11):
        n = int(torch.randint(3, 15, (1,), generator=g))
        p = int(torch.randint(1, 3, (1,), generator=g))
        mask = [0] * p + [1] * (n - p)
        if i == 4:
            mask[-2] = 0  # a non-policy token inside the response (multi-turn)
        rollout = torch.where(torch.tensor(mask) > 0, -torch.rand(n, generator=g) * 2, torch.zeros(n))
        samples.append(
            Sample(
                tokens=torch.randint(1, 50, (n,), generator=g).tolist(),
                loss_mask=mask,
                rollout_logprobs=rollout.tolist(),
                versions=[0] * n,
                advantage=float(torch.randn(1, generator=g)),
                prompt_len=p,
            )
        )
        old.append(rollout + 0.05 * torch.randn(n, generator=g))
        ref.append(rollout + 0.1 * torch.randn(n, generator=g))
        lp0.append(old[-1] + 0.3 * torch.randn(n, generator=g))  # ratios spread over the clip range
        ent0.append(torch.rand(n, generator=g) * 3)
    return samples, old, ref, lp0, ent0


SAMPLES, OLD, REF, LP0, ENT0 = _step()


def _run(cfg, split):
    dp, budget, pad = split
    packed, _ = pack_step(
        SAMPLES, dp_size=dp, token_budget=budget, loss_agg=cfg.loss_agg, pad_multiple=pad, norm_len=NORM_LEN
    )
    mbs = [mb for rank in packed for mb in rank]
    attach_per_sample(mbs, "old_logprobs", OLD)
    attach_per_sample(mbs, "ref_logprobs", REF)
    lp = [t.clone().requires_grad_() for t in LP0]
    ent = [t.clone().requires_grad_() for t in ENT0]
    fn = make_loss_fn(cfg)
    total, metrics = torch.zeros(()), []
    for mb in mbs:
        loss, m = fn(mb, gather_per_sample(mb, lp), gather_per_sample(mb, ent))
        total = total + loss
        metrics.append(m)
    total.backward()
    grads = lambda ts: [t.grad if t.grad is not None else torch.zeros_like(t) for t in ts]  # noqa: E731
    return total.detach(), grads(lp), grads(ent), finalize_loss_metrics(combine_loss_metrics(metrics)), len(mbs)


CONFIGS = [
    AlgorithmConfig(
        policy_loss=pl, loss_agg=agg, kl_coef=0.05, entropy_coef=0.01, rollout_is=ris, eps_clip=0.2, eps_clip_high=0.28
    )
    for pl, agg, ris in itertools.product(["ppo", "dual_clip", "gspo"], AGGS, ["none"])
] + [
    AlgorithmConfig(
        policy_loss=pl, loss_agg="token-mean", rollout_is=ris, rollout_is_cap=1.05, kl_coef=0.05, kl_estimator=est
    )
    for pl, ris, est in [
        ("ppo", "tis", "k1"),
        ("ppo", "mis_token", "k2"),
        ("gspo", "mis_seq", "k3"),
        ("dual_clip", "mis_seq", "k3"),
    ]
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.policy_loss}-{c.loss_agg}-{c.rollout_is}")
def test_loss_gradients_and_metrics_independent_of_split(cfg):
    ref_loss, ref_glp, ref_gent, ref_metrics, n_ref = _run(cfg, SPLITS[0])
    assert ref_loss.abs() > 1e-3  # the example is not degenerate
    assert any(g.abs().sum() > 0 for g in ref_glp)
    counts = {n_ref}
    for split in SPLITS[1:]:
        loss, glp, gent, metrics, n = _run(cfg, split)
        counts.add(n)
        assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6), (split, float(loss), float(ref_loss))
        for a, b in zip(glp + gent, ref_glp + ref_gent):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), split
        assert metrics.keys() == ref_metrics.keys()
        for k in metrics:
            assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-5, abs=1e-6), (split, k)
    assert len(counts) > 2  # the splits really differ in micro-batch count
    if cfg.rollout_is == "tis":
        assert ref_metrics["mismatch/clipped_frac"] > 0
    if cfg.rollout_is.startswith("mis"):
        assert 0 < ref_metrics["mismatch/masked_frac"] < 1


@pytest.mark.parametrize("agg", AGGS)
def test_packed_sum_equals_direct_aggregation(agg):
    # PPO without KL / entropy / IS, aggregated directly on unpacked samples
    cfg = AlgorithmConfig(policy_loss="ppo", loss_agg=agg, eps_clip=0.2)
    loss, *_ = _run(cfg, SPLITS[3])
    per_sample = []
    for s, lp, old in zip(SAMPLES, LP0, OLD):
        m = torch.tensor(s.loss_mask, dtype=torch.float32)
        out = ppo_clip_loss(lp, old, torch.full_like(lp, s.advantage), m, 0.2)
        per_sample.append((out.loss.sum(), m.sum()))
    sums = torch.stack([x for x, _ in per_sample])
    lens = torch.stack([n for _, n in per_sample])
    direct = {
        "token-mean": sums.sum() / lens.sum(),
        "seq-mean-token-mean": (sums / lens).mean(),
        "seq-mean-token-sum": sums.mean(),
        "seq-mean-token-sum-norm": sums.mean() / NORM_LEN,
    }[agg]
    assert torch.allclose(loss, direct, rtol=1e-5, atol=1e-7), (float(loss), float(direct))

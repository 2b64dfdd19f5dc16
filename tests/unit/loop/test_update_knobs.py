"""Every algorithm knob is live: the same step's data trained twice, differing only in one knob,
gives different weights (and, where theory says which way, moves the right metric the right way).

The step runs through mlrl.update.train_on (old logprobs once per step, advantages, mini-batches,
epochs, critic) with the real loss functions; the policy is the bigram model of toy_trainer.py.
Two mini-batches per step by default, so the second update sees ratio != 1 and clipping acts.
"""

from __future__ import annotations

import types

import pytest
import torch
from toy_trainer import ToyCritic, ToyPolicy, make_step

from mlrl.algorithms.kl import kl_estimate
from mlrl.config import load_config, validate
from mlrl.experience.packing import pack_step
from mlrl.loop import LoopState, Selection
from mlrl.metrics import StepTimer
from mlrl.update import train_on

BASE = ["trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.mini_batches_per_step=2",
        "algorithm.kl_coef=0", "rollout.sampling.max_new_tokens=6", "data.max_prompt_tokens=8"]
CRITIC = ["algorithm.advantage=gae", "critic.lr=1e-3"]


def run(overrides, *, step=1, lr=2.0, optimizer="sgd", select=False):
    cfg = load_config(None, [*BASE, *overrides])
    validate(cfg, has_cuda=False)
    policy = ToyPolicy(cfg, lr=lr, optimizer=optimizer)
    samples = make_step(policy=policy)
    if select:  # reward shaping / filtering of the loop before the update
        sel = Selection(types.SimpleNamespace(cfg=cfg, state=LoopState()))
        for g in sorted({s.group_id for s in samples}):
            sel.add([s for s in samples if s.group_id == g])
        samples = sel.samples
    critic = ToyCritic(cfg) if cfg.critic is not None else None
    before = policy.table.detach().clone()
    metrics = train_on(cfg, policy, critic, samples, StepTimer(), step)
    delta = policy.table.detach() - before
    return types.SimpleNamespace(m=metrics, delta=delta, norm=float(delta.norm()), policy=policy, critic=critic,
                                 samples=samples, cfg=cfg)


def kl_to_ref(r) -> float:
    lp = r.policy.logprobs_of(r.samples)
    ref = r.policy.logprobs_of(r.samples, table=r.policy.ref_table)
    masks = [torch.tensor(s.loss_mask, dtype=torch.bool) for s in r.samples]
    vals = torch.cat([kl_estimate(a, b, "k3")[m] for a, b, m in zip(lp, ref, masks)])
    return float(vals.mean())


def entropy(r) -> float:
    return float(
        torch.softmax(r.policy.table.detach(), -1)
        .mul(torch.log_softmax(r.policy.table.detach(), -1))
        .sum(-1)
        .neg()
        .mean()
    )


def differs(a, b) -> bool:
    return not torch.equal(a.delta, b.delta)


# (knob, overrides A, overrides B, check(A, B) beyond "the weights differ")
KNOBS = [
    (
        "eps_clip",
        ["algorithm.eps_clip=0.02"],
        ["algorithm.eps_clip=0.5"],
        lambda a, b: a.m["train/clip_fraction"] > b.m["train/clip_fraction"] and a.norm < b.norm,
    ),
    (
        "eps_clip_high",
        ["algorithm.eps_clip_high=0.02"],
        ["algorithm.eps_clip_high=0.8"],
        lambda a, b: a.m["train/clip_fraction"] > b.m["train/clip_fraction"],
    ),
    (
        "dual_clip_c",
        ["algorithm.policy_loss=dual_clip", "algorithm.dual_clip_c=1.05"],
        ["algorithm.policy_loss=dual_clip", "algorithm.dual_clip_c=20"],
        lambda a, b: a.m["train/clip_fraction_dual"] > b.m["train/clip_fraction_dual"],
    ),
    (
        "policy_loss=gspo",
        ["algorithm.policy_loss=ppo"],
        ["algorithm.policy_loss=gspo", "algorithm.loss_agg=seq-mean-token-mean"],
        None,
    ),
    ("kl_coef", ["algorithm.kl_coef=2.0"], ["algorithm.kl_coef=0.0"], lambda a, b: kl_to_ref(a) < kl_to_ref(b)),
    (
        "kl_estimator",
        ["algorithm.kl_coef=1.0", "algorithm.kl_estimator=k1"],
        ["algorithm.kl_coef=1.0", "algorithm.kl_estimator=k3"],
        None,
    ),
    (
        "kl_in_reward",
        ["algorithm.kl_coef=1.0", "algorithm.kl_in_reward=true"],
        ["algorithm.kl_coef=1.0", "algorithm.kl_in_reward=false"],
        None,
    ),
    (
        "entropy_coef",
        ["algorithm.entropy_coef=1.0"],
        ["algorithm.entropy_coef=0.0"],
        lambda a, b: entropy(a) > entropy(b),
    ),
    (
        "rollout_is=tis cap",
        ["algorithm.rollout_is=tis", "algorithm.rollout_is_cap=1.0"],
        ["algorithm.rollout_is=tis", "algorithm.rollout_is_cap=10"],
        lambda a, b: a.m["train/mismatch/is_weight_mean"] < b.m["train/mismatch/is_weight_mean"],
    ),
    (
        "rollout_is=mis_token cap",
        ["algorithm.rollout_is=mis_token", "algorithm.rollout_is_cap=1.1"],
        ["algorithm.rollout_is=mis_token", "algorithm.rollout_is_cap=10"],
        lambda a, b: a.m["train/mismatch/masked_frac"] > b.m["train/mismatch/masked_frac"],
    ),
    (
        "rollout_is=mis_seq",
        ["algorithm.rollout_is=mis_seq", "algorithm.rollout_is_cap=1.5"],
        ["algorithm.rollout_is=none"],
        lambda a, b: a.m["train/mismatch/seq_masked_frac"] > 0,
    ),
    (
        "icepop bounds",
        ["algorithm.rollout_is=icepop", "algorithm.icepop_low=0.9", "algorithm.icepop_high=1.1"],
        ["algorithm.rollout_is=icepop", "algorithm.icepop_low=0.1", "algorithm.icepop_high=10"],
        lambda a, b: a.m["train/mismatch/masked_frac"] > b.m["train/mismatch/masked_frac"],
    ),
    ("loss_agg", ["algorithm.loss_agg=token-mean"], ["algorithm.loss_agg=seq-mean-token-sum"], None),
    ("advantage grpo/rloo", ["algorithm.advantage=grpo"], ["algorithm.advantage=rloo"], None),
    ("advantage dr_grpo/reinforce_pp", ["algorithm.advantage=dr_grpo"], ["algorithm.advantage=reinforce_pp"], None),
    ("std_normalize", ["algorithm.std_normalize=true"], ["algorithm.std_normalize=false"], None),
    (
        "gamma",
        ["algorithm.advantage=reinforce_pp", "algorithm.gamma=1.0"],
        ["algorithm.advantage=reinforce_pp", "algorithm.gamma=0.5"],
        None,
    ),
    ("lam", [*CRITIC, "algorithm.lam=1.0"], [*CRITIC, "algorithm.lam=0.3"], None),
    ("gae std_normalize", [*CRITIC, "algorithm.std_normalize=true"], [*CRITIC, "algorithm.std_normalize=false"], None),
    (
        "epochs_per_step",
        ["trainer.epochs_per_step=3"],
        ["trainer.epochs_per_step=1"],
        lambda a, b: (
            a.m["train/updates"] == 6 and b.m["train/updates"] == 2 and a.m["train/approx_kl"] > b.m["train/approx_kl"]
        ),
    ),
    (
        "mini_batches_per_step",
        ["trainer.mini_batches_per_step=4"],
        ["trainer.mini_batches_per_step=1"],
        lambda a, b: (
            a.m["train/updates"] == 4
            and b.m["train/updates"] == 1
            and a.m["train/ratio_max"] > 1.0 == b.m["train/ratio_max"]
        ),
    ),
    (
        "use_rollout_logprobs",
        ["algorithm.use_rollout_logprobs=true", "trainer.mini_batches_per_step=1"],
        ["algorithm.use_rollout_logprobs=false", "trainer.mini_batches_per_step=1"],
        lambda a, b: a.m["train/clip_fraction"] > 0 == b.m["train/clip_fraction"],
    ),
]


@pytest.mark.parametrize("name,a,b,check", KNOBS, ids=[k[0] for k in KNOBS])
def test_knob_changes_the_update(name, a, b, check):
    ra, rb = run(a), run(b)
    assert differs(ra, rb), f"{name}: both settings gave the same update"
    if check is not None:
        assert check(ra, rb), (name, ra.m, rb.m)


def test_value_clip_changes_the_critic_update():
    a, b = run([*CRITIC, "critic.value_clip=0.001"]), run([*CRITIC, "critic.value_clip=0"])
    a2, _ = run([*CRITIC, "critic.value_clip=0.001"]), None
    assert not torch.equal(a.critic.w, b.critic.w)
    assert torch.equal(a.critic.w, a2.critic.w)  # deterministic: the difference is the knob's
    assert a.m["critic/value_clipfrac"] > b.m["critic/value_clipfrac"] == 0


def test_critic_only_steps_update_only_the_critic():
    warm = run([*CRITIC, "critic.critic_only_steps=1"], step=1)
    after = run([*CRITIC, "critic.critic_only_steps=1"], step=2)
    assert warm.m["train/updates"] == 0 and warm.norm == 0.0 and warm.m["critic/updates"] == 2
    assert after.m["train/updates"] == 2 and after.norm > 0
    assert float(warm.critic.w.detach().abs().sum()) > 0


def test_overlong_penalty_changes_rewards_and_update():
    a = run(["algorithm.overlong_buffer=4", "algorithm.overlong_penalty=1.0"], select=True)
    b = run(["algorithm.overlong_buffer=4", "algorithm.overlong_penalty=0.1"], select=True)
    c = run(["algorithm.overlong_buffer=0"], select=True)
    assert differs(a, b) and differs(b, c)
    assert sum(s.reward for s in a.samples) < sum(s.reward for s in b.samples) < sum(s.reward for s in c.samples)


def test_one_update_on_policy_runs_no_old_logprob_forward():
    one = run(["trainer.mini_batches_per_step=1"])
    assert "old_logprobs" not in one.policy.calls and one.policy.calls.count("update") == 1
    assert one.m["train/ratio_max"] == one.m["train/ratio_min"] == 1.0  # exp(lp - sg(lp))
    many = run(["trainer.mini_batches_per_step=2"])
    assert many.policy.calls.count("old_logprobs") == 1 and many.policy.calls.count("update") == 2
    with_ref = run(["trainer.mini_batches_per_step=1", "algorithm.kl_coef=0.1"])
    assert with_ref.policy.calls == ["ref_logprobs", "update"]


def test_skipped_forward_equals_a_separate_forward_on_the_same_weights():
    """One update: the detached current logprobs give exactly the update that a separate
    old-logprob forward on the same weights gives."""
    import mlrl.update as upd

    skipped = run(["trainer.mini_batches_per_step=1"])
    orig = upd.needs_old_logprobs
    upd.needs_old_logprobs = lambda cfg: True
    try:
        forced = run(["trainer.mini_batches_per_step=1"])
    finally:
        upd.needs_old_logprobs = orig
    assert "old_logprobs" in forced.policy.calls
    assert torch.equal(skipped.delta, forced.delta)


def test_updates_are_deterministic():
    a, b = run(["trainer.epochs_per_step=2"]), run(["trainer.epochs_per_step=2"])
    assert torch.equal(a.delta, b.delta) and a.m == b.m


@pytest.mark.parametrize("overrides", [[], CRITIC, [*CRITIC, "trainer.shared_prefix_packing=always"],
                                       ["algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true"],
                                       ["algorithm.advantage=reinforce_pp", "algorithm.kl_coef=0.1",
                                        "algorithm.kl_in_reward=true"]])
def test_one_step_packs_once_and_computes_advantages_once(overrides, monkeypatch):
    """The step's samples are packed once for the forward phase and, with one mini-batch, trained
    on that same packing; advantages are computed once, after the forward phase (also where the
    estimator reads it: KL in the reward, GAE), and the packed advantages are exactly what a
    packing made after them would hold."""
    import mlrl.update as upd

    packs, advs, packed = [], [], []

    def counting_pack(samples, **kw):
        packs.append(len(samples))
        out = pack_step(samples, **kw)
        packed.append((out[0], kw))
        return out

    def counting_adv(*args, **kw):
        advs.append(kw)
        return orig_adv(*args, **kw)

    orig_adv = upd.compute_advantages
    monkeypatch.setattr(upd, "pack_step", counting_pack)
    monkeypatch.setattr(upd, "compute_advantages", counting_adv)
    r = run(["trainer.mini_batches_per_step=1", *overrides])
    assert len(packs) == 1 and len(advs) == 1
    assert r.policy.calls[-1] == "update" and "update" not in r.policy.calls[:-1]  # the forward phase came first
    per_dp, kw = packed[0]
    fresh, _ = pack_step(r.samples, **kw)
    nonzero = 0
    for a, b in zip([mb for rank in per_dp for mb in rank], [mb for rank in fresh for mb in rank]):
        assert torch.equal(a.advantages, b.advantages)
        nonzero += int(a.advantages.ne(0).sum())
    assert nonzero > 0  # the advantages exist: the comparison is not between zeros


@pytest.mark.parametrize("overrides", [
    ["algorithm.kl_coef=0.05"],                                                          # KL in the loss
    ["algorithm.kl_coef=0.05", "algorithm.kl_in_reward=true", "algorithm.kl_estimator=k1",
     "algorithm.advantage=reinforce_pp", "algorithm.gamma=0"],                           # on-policy distillation
])
def test_reference_kl_is_the_k1_mean_over_the_steps_policy_tokens(overrides):
    """`reference/kl`: E[log pi - log pi_ref] over the sampled tokens, from the logprobs the step
    trained against (what on-policy distillation lowers when the reference is a teacher)."""
    cfg = load_config(None, [*BASE, *overrides])
    validate(cfg, has_cuda=False)
    policy = ToyPolicy(cfg, lr=2.0)
    torch.manual_seed(3)
    policy.ref_table = policy.ref_table + torch.randn_like(policy.ref_table)  # a teacher: another model
    samples = make_step(policy=policy)
    want = kl_to_ref_k1(policy, samples)
    m = train_on(cfg, policy, None, samples, StepTimer(), 1)
    assert m["reference/kl"] == pytest.approx(want, rel=1e-5) and want > 0.1
    assert "reference/kl" not in run([]).m  # no KL term, no reference model


def kl_to_ref_k1(policy, samples) -> float:
    lp = policy.logprobs_of(samples)
    ref = policy.logprobs_of(samples, table=policy.ref_table)
    masks = [torch.tensor(s.loss_mask, dtype=torch.bool) for s in samples]
    return float(torch.cat([kl_estimate(a, b, "k1")[m] for a, b, m in zip(lp, ref, masks)]).mean())

"""The trainer side of one RL step: behaviour / reference logprobs, critic values, advantages,
then `trainer.mini_batches_per_step` x `trainer.epochs_per_step` optimizer updates.

Order kept, and why:
1. every forward pass that feeds the whole step runs first, on the weights the samples were
   generated with (sync) or the newest ones (async), before any update:
   - behaviour ("old") logprobs, the denominator of the PPO ratio, once per step. They are
     skipped when the step makes exactly one update and nothing else needs them: the loss then
     uses the current logprobs, detached (ratio = exp(lp - sg(lp)) = 1 with the same gradient),
     which is exactly what a separate forward on the same weights would give, one forward pass
     cheaper. `algorithm.use_rollout_logprobs` takes them from the engines instead;
   - reference logprobs (KL), critic values (GAE);
2. advantages (and GAE returns) over the whole step: group baselines see every group;
3. the samples are split by prompt group into mini-batches; each mini-batch is packed with its
   own loss normalisation and makes one optimizer update, for every epoch. From the second
   update on, the current policy differs from the behaviour policy: ratio != 1, clipping acts.
   The critic, when there is one, makes one update per mini-batch too (after `critic.critic_only_steps`
   RL steps of critic-only updates, the policy updates as well).

Metrics of the updates are combined into one value per step (`combine_update_metrics`).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from mlrl.algorithms.advantages import RETURNS_KEY, compute_advantages
from mlrl.algorithms.kl import kl_estimate
from mlrl.algorithms.value import explained_variance
from mlrl.config import Config
from mlrl.experience.minibatch import split_groups
from mlrl.experience.packing import (
    attach_per_sample,
    pack_step,
    set_advantages,
    token_advantages,
    unpack_per_sample,
)
from mlrl.interfaces import Critic, PerDP, Policy
from mlrl.metrics import StepTimer
from mlrl.types import Sample

log = logging.getLogger(__name__)

def needs_old_logprobs(cfg: Config) -> bool:
    """A separate behaviour-logprob forward is needed when more than one update uses them, or
    when the KL goes into the reward (advantages need the policy's logprobs before any update)."""
    t, a = cfg.trainer, cfg.algorithm
    if a.use_rollout_logprobs:
        return False
    return t.mini_batches_per_step * t.epochs_per_step > 1 or (a.kl_in_reward and a.kl_coef > 0)


def train_on(cfg: Config, policy: Policy, critic: Critic | None, samples: list[Sample], timer: StepTimer,
             step: int) -> dict[str, float]:
    """All updates of one RL step (blocking trainer calls). Returns the step's train/critic metrics."""
    a, t = cfg.algorithm, cfg.trainer
    temperature = cfg.rollout.sampling.logprob_temperature
    check_rollout_logprobs(cfg, samples)
    kl_in_loss = a.kl_coef > 0 and not a.kl_in_reward
    # the step's samples, packed once (advantages are set on the packing below, once they exist)
    whole, pack_metrics = _pack(cfg, policy, samples)
    # 1. the forward phase
    old = ref = values = None
    with timer("logprobs"):
        if a.router_replay:
            pack_metrics.update(router_metrics(policy, whole, samples, temperature))
        if needs_old_logprobs(cfg):
            old = _per_sample(whole, policy.compute_logprobs(whole, temperature), len(samples))
        if a.kl_coef > 0:
            ref = _per_sample(whole, policy.compute_logprobs(whole, temperature, reference=True), len(samples))
        if critic is not None:
            out = critic.compute_values(whole)
            values = unpack_per_sample([mb for r in whole for mb in r], [v for r in out for v in r], len(samples))
    if a.use_rollout_logprobs:
        old = [torch.tensor(s.rollout_logprobs, dtype=torch.float32) for s in samples]
    # 2. advantages, once, over the whole step (the KL-in-reward and GAE estimators read the forward phase)
    if (a.kl_in_reward and a.kl_coef > 0) or critic is not None:
        compute_advantages(samples, a, ref_logprobs=ref, policy_logprobs=old, values=values)
    else:
        compute_advantages(samples, a)
    set_advantages([mb for r in whole for mb in r], samples)
    returns: list[torch.Tensor] = []
    if critic is not None:
        assert values is not None and cfg.critic is not None  # both exist whenever there is a critic
        returns = [torch.tensor(s.metadata[RETURNS_KEY], dtype=torch.float32) for s in samples]
    values = values or []

    # 3. the optimizer updates
    actor_updates = critic is None or cfg.critic is None or step > cfg.critic.critic_only_steps
    parts = split_groups(samples, t.mini_batches_per_step)
    policy_metrics: list[dict[str, float]] = []
    critic_metrics: list[dict[str, float]] = []
    with timer("train"):
        for _epoch in range(t.epochs_per_step):
            for idx in parts:
                mb_samples = [samples[i] for i in idx]
                per_dp = whole if len(parts) == 1 else _pack(cfg, policy, mb_samples)[0]
                flat = [mb for r in per_dp for mb in r]
                if old is not None:
                    attach_per_sample(flat, "old_logprobs", [old[i] for i in idx])
                if ref is not None and kl_in_loss:
                    attach_per_sample(flat, "ref_logprobs", [ref[i] for i in idx])
                if critic is not None:
                    attach_per_sample(flat, "old_values", [values[i] for i in idx])
                    attach_per_sample(flat, "returns", [returns[i] for i in idx])
                    critic_metrics.append(critic.update(per_dp))
                if actor_updates:
                    policy_metrics.append(policy.update(per_dp))
    metrics = {**pack_metrics, **{f"train/{k}": v for k, v in combine_update_metrics(policy_metrics).items()}}
    metrics["train/updates"] = float(len(policy_metrics))
    if critic is not None:
        metrics.update(
            {f"critic/{k}": v for k, v in combine_update_metrics(critic_metrics).items() if k not in _CRITIC_QUIET}
        )
        metrics["critic/updates"] = float(len(critic_metrics))
        masks = [torch.tensor(s.loss_mask, dtype=torch.bool) for s in samples]
        v_all = torch.cat([v[m] for v, m in zip(values, masks)])
        r_all = torch.cat([r[m] for r, m in zip(returns, masks)])
        metrics["critic/values_mean"] = float(v_all.mean()) if v_all.numel() else 0.0
        metrics["critic/returns_mean"] = float(r_all.mean()) if r_all.numel() else 0.0
        ev = explained_variance(v_all, r_all, torch.ones_like(v_all, dtype=torch.bool))
        if ev == ev:  # undefined (nan) when every return is equal, e.g. no reward at all: left out
            metrics["critic/explained_variance"] = ev
    if ref is not None:
        metrics.update(reference_kl(samples, ref, old))
    adv = [v for s in samples for v, m in zip(token_advantages(s), s.loss_mask) if m]
    if adv:
        metrics["advantages/mean"] = sum(adv) / len(adv)
        metrics["advantages/abs_mean"] = sum(abs(x) for x in adv) / len(adv)
    return metrics


def reference_kl(samples: Sequence[Sample], ref: Sequence[torch.Tensor],
                 old: Sequence[torch.Tensor] | None) -> dict[str, float]:
    """`reference/kl`: the policy's KL to the reference model per policy token, k1's unbiased estimate
    E_pi[log pi - log pi_ref] over the step's sampled tokens, whatever kl_estimator the loss or
    reward uses (with a teacher, algorithm.reference_hf_dir, what on-policy distillation lowers).
    The policy side: the behaviour logprobs when the step computed them, else the engines'
    (they agree with the trainer's to the logged mismatch); none when a workflow returned no logprobs."""
    if old is None:
        if any(s.metadata.get("missing_logprobs") for s in samples):
            return {}
        old = [torch.tensor(s.rollout_logprobs, dtype=torch.float32) for s in samples]
    kl = [kl_estimate(p.float(), r.float(), "k1")[torch.tensor(s.loss_mask, dtype=torch.bool)]
          for p, r, s in zip(old, ref, samples)]
    flat = torch.cat(kl) if kl else torch.zeros(0)
    return {"reference/kl": float(flat.mean())} if flat.numel() else {}


def check_rollout_logprobs(cfg: Config, samples: Sequence[Sample]) -> None:
    """The engine's logprobs enter the loss with algorithm.rollout_is (the behaviour policy of the
    importance weights) and use_rollout_logprobs (the PPO ratio's old policy). A workflow that
    returned its samples without them (metadata["missing_logprobs"]: an AReaL-style result dict or a
    Trinity experience without logprobs) would get weights / ratios against 0.0: refused, naming it."""
    a = cfg.algorithm
    uses = "algorithm.use_rollout_logprobs=true" if a.use_rollout_logprobs else (
        f"algorithm.rollout_is={a.rollout_is}" if a.rollout_is != "none" else None)
    missing = sum(bool(s.metadata.get("missing_logprobs")) for s in samples)
    if uses and missing:
        raise ValueError(f"{uses} needs the engine's logprob of every policy token, but workflow "
                         f"{cfg.workflow.name} returned {missing} of {len(samples)} sample(s) without logprobs: return "
                         "them (the result's 'logprobs'), or turn the setting off")


def router_metrics(policy: Policy, whole: PerDP, samples: Sequence[Sample], temperature: float) -> dict[str, float]:
    """MoE router replay, before any update: how often the trainer's own routing picks the
    engine's experts (token x MoE layer top-k sets), and the train/rollout logprob gap over the
    policy tokens with the engine's routes replayed and with the trainer's own routing."""
    d = policy.router_diagnostics(whole, temperature)
    out = {"mismatch/router_agreement": d.matches / d.compared if d.compared else float("nan")}
    for per_dp, name in ((d.replay, "logprob_gap_replay"), (d.own, "logprob_gap_no_replay")):
        lps = _per_sample(whole, [[(lp, None) for lp in r] for r in per_dp], len(samples))
        gaps = [(lp - torch.tensor(s.rollout_logprobs)).abs()[torch.tensor(s.loss_mask, dtype=torch.bool)]
                for lp, s in zip(lps, samples)]
        flat = torch.cat(gaps) if gaps else torch.zeros(0)
        out[f"mismatch/{name}"] = float(flat.mean()) if flat.numel() else float("nan")
        out[f"mismatch/{name}_max"] = float(flat.max()) if flat.numel() else float("nan")
    return out


def _pack(cfg: Config, policy: Policy, samples: Sequence[Sample]) -> tuple[PerDP, dict[str, float]]:
    return pack_step(samples, dp_size=policy.dp_size, token_budget=cfg.trainer.token_budget,
                     loss_agg=cfg.algorithm.loss_agg, norm_len=cfg.rollout.sampling.max_new_tokens,
                     shared_prefix=cfg.uses_shared_prefix_packing)


def _per_sample(per_dp: PerDP, out: list[list[tuple[torch.Tensor, Any]]], n: int) -> list[torch.Tensor]:
    flat = [mb for rank in per_dp for mb in rank]
    return unpack_per_sample(flat, [lp for rank in out for lp, _ in rank], n)


# the critic's update returns the policy's bookkeeping keys too: "loss" repeats value_loss and
# the token / micro-batch counts repeat the policy's
_CRITIC_QUIET = {"loss", "tokens", "loss_tokens", "n_tokens", "num_micro_batches", "skipped"}

# keys summed over updates; "_max" / "_min" keys reduce by max / min; "lr" is the last update's;
# everything else is a per-update mean, averaged over updates weighted by the update's loss tokens
_SUMMED = {"n_tokens", "n_seqs", "tokens", "loss_tokens", "num_micro_batches", "skipped", "time_s",
           "forward_backward_s", "optimizer_s"}


def combine_update_metrics(updates: Sequence[dict[str, float]]) -> dict[str, float]:
    """One value per key for a step made of several optimizer updates."""
    out: dict[str, float] = {}
    if not updates:
        return out
    weights = [max(float(u.get("loss_tokens", u.get("n_tokens", 1.0))), 0.0) for u in updates]
    if sum(weights) <= 0:
        weights = [1.0] * len(updates)
    for k in sorted({k for u in updates for k in u}):
        present = [(u[k], w) for u, w in zip(updates, weights) if k in u]
        vals = [v for v, _ in present]
        if k in _SUMMED:
            out[k] = float(sum(vals))
        elif k.endswith("_max"):
            out[k] = float(max(vals))
        elif k.endswith("_min"):
            out[k] = float(min(vals))
        elif k == "lr":
            out[k] = float(vals[-1])
        else:
            wsum = sum(w for _, w in present)
            out[k] = float(sum(v * w for v, w in present) / wsum) if wsum > 0 else float(sum(vals) / len(vals))
    return out

"""Policy losses, KL / entropy terms and loss aggregation, computed on one packed micro-batch.

Contract with the trainer and the packer (mlrl/experience/batch.py): the trainer computes per-token
logprobs (and entropy) for one MicroBatch and calls

    loss, metrics = loss_fn(mb, logprobs [S], entropy [S] | None)

The returned loss is sum_t mb.loss_weight[t] * l_t, with the per-token loss

    l_t = keep_t * ( w_t * pg_t  +  kl_coef * kl_t  -  entropy_coef * H_t )

pg_t the policy-gradient term (PPO clip / dual-clip / GSPO), w_t and keep_t the train/rollout
importance weight and mask (mlrl.algorithms.mismatch; 1 when rollout_is is "none"), kl_t the KL
to the reference (only when kl_coef > 0 and the KL is not in the reward), H_t the entropy.
Because loss_weight already carries the step-wide aggregation (`loss_agg_weights`, applied by the
packer over every sample of the step), summing `loss` over all micro-batches and DP ranks gives
the step loss, and gradients are independent of how the step was split: the invariant the unit
tests check. Each sample lies whole in one micro-batch, so sequence-level quantities (GSPO's
ratio, sequence-level masking) are computed locally from mb.cu_seqlens.

Metrics are additive 0-dim tensors (see mlrl.algorithms.loss_metrics for how to reduce them).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from mlrl.algorithms.kl import KL_ESTIMATORS, LOG_RATIO_BOUND, kl_estimate
from mlrl.algorithms.mismatch import ROLLOUT_IS_MODES, rollout_correction
from mlrl.algorithms.segments import segment_index, segment_sum
from mlrl.config.schema import AlgorithmConfig
from mlrl.experience.batch import MicroBatch
from mlrl.experience.loss_weights import LOSS_AGG_MODES, loss_agg_weights  # noqa: F401 - loss_agg_weights: re-exported

# --------------------------------------------------------------------------- policy-gradient terms


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor          # [S] per-token policy-gradient loss pg_t, 0 where mask is 0
    ratio: torch.Tensor         # [S] ratio used by the objective (token or sequence), detached
    clipped: torch.Tensor       # [S] 1 where the clipped term was chosen (it is > the unclipped one)
    dual_clipped: torch.Tensor  # [S] 1 where the dual-clip bound -c*A was active


def _masked_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # masked *before* exp: padding positions may hold anything, and exp(inf) * 0 = nan in backward
    d = torch.where(mask > 0, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    return d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _clipped_objective(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: Optional[float],
) -> PolicyLossOutput:
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = (clipped > unclipped).to(ratio.dtype)
    dual = torch.zeros_like(is_clipped)
    if dual_clip_c is not None:
        bound = -dual_clip_c * advantages
        active = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
        dual = active.to(ratio.dtype)
    m = (mask > 0).to(ratio.dtype)
    return PolicyLossOutput(loss * m, ratio.detach() * m, is_clipped * m, dual * m)


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: Optional[float] = None,
    dual_clip_c: Optional[float] = None,
) -> PolicyLossOutput:
    """PPO clip (Schulman et al. 2017) per token, with DAPO clip-higher and dual-clip.

        rho_t = exp(log pi(y_t) - log pi_old(y_t))
        pg_t  = max(-A_t * rho_t, -A_t * clip(rho_t, 1 - eps_low, 1 + eps_high))
        dual-clip (Ye et al. 2020, c > 1), only where A_t < 0:  pg_t = min(pg_t, -c * A_t)

    eps_high=None means eps_high = eps_low (symmetric PPO); DAPO uses eps_high > eps_low so that
    low-probability tokens can grow. Dual-clip bounds the loss of a negative-advantage token
    whose ratio exploded (its gradient is then 0).
    """
    eps_high = eps_low if eps_high is None else eps_high
    if dual_clip_c is not None and dual_clip_c <= 1:
        raise ValueError(f"dual_clip_c={dual_clip_c}: expected > 1")
    ratio = torch.exp(_masked_log_ratio(logprobs, old_logprobs, mask))
    return _clipped_objective(ratio, advantages, mask, eps_low, eps_high, dual_clip_c)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seg: torch.Tensor,
    num_seqs: int,
    eps_low: float = 0.2,
    eps_high: Optional[float] = None,
) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025): sequence-level ratio, clipped at sequence level.

        s_i     = exp( 1/|y_i| * sum_{t in y_i} (log pi(y_t) - log pi_old(y_t)) )   (geometric mean)
        s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]      (GSPO-token: value s_i, gradient s_i * grad log pi(y_t))
        pg_t    = max(-A_t * s_{i,t}, -A_t * clip(s_{i,t}, 1 - eps_low, 1 + eps_high))

    With a sequence-level advantage and loss_agg="seq-mean-token-mean", sum_t pg_t / |y_i| has
    exactly the gradient of the paper's -min(s_i A_i, clip(s_i) A_i): use that aggregation. The
    paper's clip range is far narrower than PPO's (eps ~ 3e-4 / 4e-4). seg / num_seqs come from
    mlrl.algorithms.segments.segment_index.
    """
    eps_high = eps_low if eps_high is None else eps_high
    m = (mask > 0).to(logprobs.dtype)
    d = _masked_log_ratio(logprobs, old_logprobs, mask)
    n_tok = segment_sum(m, seg, num_seqs)
    log_s = segment_sum(d.detach(), seg, num_seqs) / n_tok.clamp(min=1)
    log_s_tok = torch.cat([log_s, log_s.new_zeros(1)])[seg]
    lp = torch.where(m > 0, logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_s_tok + lp - lp.detach())
    return _clipped_objective(ratio, advantages, mask, eps_low, eps_high, None)


PolicyLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, AlgorithmConfig], PolicyLossOutput
]


def _eps(cfg: AlgorithmConfig) -> tuple[float, float]:
    return cfg.eps_clip, cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high


# (logprobs, old_logprobs, advantages, mask, seg, num_seqs, cfg) -> PolicyLossOutput
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": lambda lp, old, adv, m, seg, n, cfg: ppo_clip_loss(lp, old, adv, m, *_eps(cfg)),
    "dual_clip": lambda lp, old, adv, m, seg, n, cfg: ppo_clip_loss(
        lp, old, adv, m, *_eps(cfg), dual_clip_c=cfg.dual_clip_c
    ),
    "gspo": lambda lp, old, adv, m, seg, n, cfg: gspo_loss(lp, old, adv, m, seg, n, *_eps(cfg)),
}


# --------------------------------------------------------------------------- the loss function

LossFn = Callable[[MicroBatch, torch.Tensor, Optional[torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def make_loss_fn(algo_cfg: AlgorithmConfig) -> LossFn:
    """Build `loss_fn(mb, logprobs [S], entropy [S] | None) -> (loss, metrics)` for one config.

    - old logprobs: mb.old_logprobs; None means on-policy (old = logprobs.detach(), ratio 1).
    - KL: with kl_coef > 0 and not kl_in_reward, mb.ref_logprobs is required; whenever
      mb.ref_logprobs is given, the KL is reported as metric "kl".
    - entropy: required when entropy_coef > 0; reported as metric "entropy" when given.
    - metrics: "loss", "pg_loss", "kl_loss", "entropy_loss" (loss_weight-weighted step sums),
      token sums "ratio_mean", "clip_fraction", "clip_fraction_dual", "approx_kl", "kl", "entropy", "mismatch/*",
      counts "n_tokens", "n_seqs", and "ratio_max" / "ratio_min" (see loss_metrics).
    """
    if algo_cfg.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"algorithm.policy_loss={algo_cfg.policy_loss!r}: expected one of {sorted(POLICY_LOSSES)}")
    if algo_cfg.loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"algorithm.loss_agg={algo_cfg.loss_agg!r}: expected one of {LOSS_AGG_MODES}")
    if algo_cfg.rollout_is not in ROLLOUT_IS_MODES:
        raise ValueError(f"algorithm.rollout_is={algo_cfg.rollout_is!r}: expected one of {ROLLOUT_IS_MODES}")
    if algo_cfg.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"algorithm.kl_estimator={algo_cfg.kl_estimator!r}: expected one of {KL_ESTIMATORS}")
    policy = POLICY_LOSSES[algo_cfg.policy_loss]
    kl_in_loss = algo_cfg.kl_coef > 0 and not algo_cfg.kl_in_reward

    def loss_fn(
        mb: MicroBatch, logprobs: torch.Tensor, entropy: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        s = mb.num_tokens
        if logprobs.shape != (s,):
            raise ValueError(f"loss_fn: logprobs has shape {tuple(logprobs.shape)}, expected ({s},) like mb.tokens")
        if entropy is not None and entropy.shape != (s,):
            raise ValueError(f"loss_fn: entropy has shape {tuple(entropy.shape)}, expected ({s},) like mb.tokens")
        dt = logprobs.dtype
        m = (mb.loss_mask > 0).to(dt)
        weight = mb.loss_weight.to(dt) * m
        old = mb.old_logprobs.to(dt) if mb.old_logprobs is not None else logprobs.detach()
        seg = segment_index(mb.cu_seqlens, s)
        n = mb.num_samples

        pg = policy(logprobs, old, mb.advantages.to(dt) * m, m, seg, n, algo_cfg)
        is_w, keep, mm = rollout_correction(
            old,
            mb.rollout_logprobs,
            m,
            algo_cfg.rollout_is,
            algo_cfg.rollout_is_cap,
            seg,
            n,
            bounds=(algo_cfg.icepop_low, algo_cfg.icepop_high),
        )
        wk = weight * keep
        token_loss = is_w * pg.loss
        metrics: dict[str, torch.Tensor] = {"pg_loss": (wk * token_loss).sum().detach()}

        kl: Optional[torch.Tensor] = None
        if mb.ref_logprobs is not None:
            kl = torch.where(
                m > 0, kl_estimate(logprobs, mb.ref_logprobs.to(dt), algo_cfg.kl_estimator), torch.zeros_like(m)
            )
            metrics["kl"] = (kl.detach() * m).sum()
        if kl_in_loss:
            if kl is None:  # no mb.ref_logprobs
                raise ValueError(
                    "loss_fn: algorithm.kl_coef > 0 with the KL in the loss needs mb.ref_logprobs (attach the "
                    "reference logprobs)"
                )
            token_loss = token_loss + algo_cfg.kl_coef * kl
            metrics["kl_loss"] = (wk * algo_cfg.kl_coef * kl).sum().detach()
        ent: Optional[torch.Tensor] = None
        if entropy is not None:
            ent = torch.where(m > 0, entropy, torch.zeros_like(m))
            metrics["entropy"] = (ent.detach() * m).sum()
        if algo_cfg.entropy_coef > 0:
            if ent is None:  # no entropy
                raise ValueError("loss_fn: algorithm.entropy_coef > 0 needs the per-token entropy")
            token_loss = token_loss - algo_cfg.entropy_coef * ent
            metrics["entropy_loss"] = (-wk * algo_cfg.entropy_coef * ent).sum().detach()

        loss = (wk * token_loss).sum()
        mask_b = m > 0
        metrics.update(
            loss=loss.detach(),
            n_tokens=m.sum(),
            n_seqs=(segment_sum(m, seg, n) > 0).to(dt).sum(),
            ratio_mean=pg.ratio.sum(),
            ratio_max=torch.where(mask_b, pg.ratio, torch.full_like(m, float("-inf"))).max(),
            ratio_min=torch.where(mask_b, pg.ratio, torch.full_like(m, float("inf"))).min(),
            clip_fraction=pg.clipped.sum(),
            # KL(old || current) per token, Schulman's k3 estimator (r - 1) - log r with r = pi / pi_old:
            # how far this update has moved from the behaviour policy (0 on the first update)
            approx_kl=(kl_estimate(old, logprobs.detach(), "k3") * m).sum(),
            **mm,
        )
        if algo_cfg.policy_loss == "dual_clip":
            metrics["clip_fraction_dual"] = pg.dual_clipped.sum()
        return loss, metrics

    return loss_fn

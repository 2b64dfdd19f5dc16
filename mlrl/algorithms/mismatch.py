"""Train / rollout mismatch: the engine that sampled a token (vLLM, rollout logprobs) and the
trainer that scores it (Megatron, old logprobs) never agree exactly (kernels, precision, stale
weights in async mode), so the policy-gradient samples are slightly off-policy.

Rollout logprobs are always kept in the experience, so the gap is always measured; when
`algorithm.rollout_is != "none"` it is also corrected with per-token weights that multiply the
policy-gradient term of the loss. With rho_t = exp(old_t - rollout_t) (trainer over engine):

    tis        w_t = min(rho_t, cap)                                  (truncated IS)
    mis_token  w_t = rho_t,   token kept iff 1/cap <= rho_t <= cap    (masked IS, token level)
    mis_seq    w_t = rho_i,   sequence kept iff 1/cap <= rho_i <= cap, rho_i = prod_t rho_t
                                                                       (masked IS, sequence level)
    icepop     w_t = rho_t,   token kept iff low <= rho_t <= high     (IcePop, Ling team 2025:
               double-sided masking with calibration; low / high = algorithm.icepop_low / _high)

as in "Your efficient RL framework secretly brings you off-policy RL training" (Yao et al. 2025)
and "When Speed Kills Stability" (Liu, Li et al. 2025). Departure: a masked token keeps its share
of the step normalisation (MicroBatch.loss_weight is fixed by the packer before the old logprobs
exist), so masking lowers the loss scale instead of renormalising over the kept tokens; this is
what keeps the loss independent of the micro-batch split. All weights are detached.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

from mlrl.algorithms.kl import LOG_RATIO_BOUND, kl_estimate
from mlrl.algorithms.segments import segment_sum

RolloutIS = Literal["none", "tis", "mis_token", "mis_seq", "icepop"]
ROLLOUT_IS_MODES: tuple[str, ...] = ("none", "tis", "mis_token", "mis_seq", "icepop")


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: RolloutIS,
    cap: float,
    seg: Optional[torch.Tensor] = None,
    num_seqs: Optional[int] = None,
    bounds: tuple[float, float] = (0.5, 5.0),
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights for one packed row: (weight [S], keep [S], metric sums).

    weight multiplies the policy-gradient term of each token, keep (0/1) the whole token loss;
    both are 0 where mask is 0. seg / num_seqs (mlrl.algorithms.segments.segment_index) are
    needed by mis_seq only; bounds = (low, high) by icepop only. Metric values are sums over loss
    tokens (mlrl.algorithms.loss_metrics gives their denominators): logprob gap, k3 KL(rollout ||
    trainer), mean weight, fraction truncated (tis) or masked (mis_*, icepop), and for mis_seq the
    number of masked sequences.
    """
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"algorithm.rollout_is={mode!r}: expected one of {ROLLOUT_IS_MODES}")
    if mode != "none" and cap < 1:
        raise ValueError(f"algorithm.rollout_is_cap={cap}: expected >= 1")
    m = (mask > 0).to(old_logprobs.dtype)
    old = old_logprobs.detach()
    rollout = rollout_logprobs.detach().to(old.dtype)
    log_rho = torch.where(m > 0, old - rollout, torch.zeros_like(old)).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    rho = torch.exp(log_rho)
    metrics = {
        "mismatch/logprob_gap": (log_rho.abs() * m).sum(),
        # k3 with samples from the rollout policy: KL(rollout || trainer); d = rollout - old
        "mismatch/k3_kl": (kl_estimate(rollout, old, "k3") * m).sum(),
    }
    ones = torch.ones_like(rho)
    if mode == "none":
        weight, keep = ones, ones
    elif mode == "tis":
        weight, keep = torch.clamp(rho, max=cap), ones
        metrics["mismatch/clipped_frac"] = ((rho > cap).to(m.dtype) * m).sum()
    elif mode == "mis_token":
        weight = rho
        keep = ((rho >= 1.0 / cap) & (rho <= cap)).to(m.dtype)
    elif mode == "icepop":
        low, high = bounds
        if not 0 < low < high:
            raise ValueError(f"algorithm.icepop_low / icepop_high = {low} / {high}: expected 0 < low < high")
        weight = rho
        keep = ((rho >= low) & (rho <= high)).to(m.dtype)
    else:
        if seg is None or num_seqs is None:
            raise ValueError("rollout_correction(mode='mis_seq') needs seg and num_seqs (per-sequence segmentation)")
        log_rho_seq = segment_sum(log_rho, seg, num_seqs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        rho_seq = torch.exp(log_rho_seq)
        keep_seq = ((rho_seq >= 1.0 / cap) & (rho_seq <= cap)).to(m.dtype)
        has_tokens = segment_sum(m, seg, num_seqs) > 0
        pad = torch.ones(1, dtype=m.dtype)
        weight = torch.cat([rho_seq, pad])[seg]
        keep = torch.cat([keep_seq, pad])[seg]
        metrics["mismatch/seq_masked_frac"] = ((1 - keep_seq) * has_tokens.to(m.dtype)).sum()
    weight, keep = weight * m, keep * m
    if mode in ("mis_token", "mis_seq", "icepop"):
        metrics["mismatch/masked_frac"] = ((1 - keep) * m).sum()
    metrics["mismatch/is_weight_mean"] = (weight * keep).sum()
    return weight, keep, metrics


def mismatch_metrics(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Step-level train/rollout gap for logging (e.g. right after a weight sync), as plain means
    over the tokens where mask is 1: "mismatch/logprob_gap" (mean |train - rollout|),
    "mismatch/logprob_gap_max" and "mismatch/k3_kl" (KL(rollout || trainer)). Any shape."""
    m = mask > 0
    if not bool(m.any()):
        raise ValueError("mismatch_metrics: mask selects no token")
    t, r = train_logprobs.detach()[m].to(torch.float64), rollout_logprobs.detach()[m].to(torch.float64)
    gap = (t - r).abs()
    return {
        "mismatch/logprob_gap": float(gap.mean()),
        "mismatch/logprob_gap_max": float(gap.max()),
        "mismatch/k3_kl": float(kl_estimate(r, t, "k3").mean()),
    }


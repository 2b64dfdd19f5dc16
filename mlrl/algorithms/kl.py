"""KL estimators from sampled tokens (Schulman, "Approximating KL divergence", 2020).

Used in three places that must agree: the KL-to-reference term of the loss, the KL penalty folded
into the reward (kl_in_reward), and the train-vs-rollout mismatch metric. The log-ratio is clamped
before any exp so that one outlier token cannot turn a loss or a metric into inf.
"""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
LOG_RATIO_BOUND = 20.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) for tokens sampled from pi.

    With d_t = log pi(y_t) - log pi_ref(y_t), clamped to [-20, 20]:
        k1 = d_t                        unbiased, high variance, may be negative
        k2 = d_t^2 / 2                  biased, low variance, >= 0
        k3 = exp(-d_t) - 1 + d_t        unbiased, low variance, >= 0
    Same shape as the inputs; gradients flow into both arguments.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator {estimator!r}: expected one of {KL_ESTIMATORS}")
    d = (logprobs - ref_logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.exp(-d) - 1.0 + d


def kl_reward_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    estimator: KLEstimator = "k3",
) -> torch.Tensor:
    """Per-token reward term -kl_coef * kl_t on policy tokens (0 elsewhere), detached.

    This is "KL in the reward" (PPO-RLHF, REINFORCE++): the penalty enters the returns instead of
    the loss, so it carries no gradient of its own.
    """
    kl = kl_estimate(logprobs.detach(), ref_logprobs.detach(), estimator)
    return torch.where(mask > 0, -kl_coef * kl, torch.zeros_like(kl))

"""The critic's value loss (PPO + GAE) on one packed micro-batch, and explained variance.

Contract with the trainer (mlrl.trainer.rank.critic.MegatronCritic.update), the same as the
policy loss's (mlrl.algorithms.losses): the trainer computes the token-aligned values of one
MicroBatch (values[t] = V(tokens[<t]), the alignment of mlrl.experience.batch) and calls

    loss, metrics = value_loss_fn(mb, values [S])

with, per loss token t (loss_mask 1), R_t = mb.returns[t], V_old = mb.old_values[t] and c the
clip range (critic.value_clip),

    V_clip = V_old + clamp(V - V_old, -c, c)
    l_t    = 0.5 * max((V - R_t)^2, (V_clip - R_t)^2)        c > 0  (PPO2's clipped value loss)
    l_t    = 0.5 * (V - R_t)^2                               c = 0  (plain regression)
    loss   = sum_t mb.loss_weight[t] * l_t

loss_weight carries the step-wide aggregation (the packer's loss_agg_weights), so summing `loss`
over all micro-batches and DP ranks gives the step loss and the gradient does not depend on the
split. Departure from some implementations (e.g. OpenAI baselines' ppo2): the step loss is
aggregated with the policy's loss_agg weights, not a plain mean over the batch.

Metrics are additive 0-dim tensors (mlrl.algorithms.loss_metrics): "value_loss" (the weighted
sum, like "loss"), "values" and "returns" (sums over loss tokens; means with "n_tokens"),
"value_clipfrac" (loss tokens where the clipped term was the larger; a fraction with
"n_tokens"), "n_tokens".
"""

from __future__ import annotations

from typing import Callable

import torch

from mlrl.experience.batch import MicroBatch

ValueLossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor | None, returns: torch.Tensor,
                       value_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (l_t [S], clipped_t [S]) of the module docstring; clipped_t is 1 where the clipped
    term is strictly larger (the gradient then flows through V_clip, i.e. is 0 outside the clip
    range). value_clip = 0: unclipped, old_values unused."""
    err = values - returns
    loss = 0.5 * err.square()
    if value_clip <= 0:
        return loss, torch.zeros_like(loss)
    if old_values is None:
        raise ValueError("value_clip > 0 needs old_values (the critic's values before the update)")
    old = old_values.detach()
    v_clip = old + (values - old).clamp(-value_clip, value_clip)
    loss_clip = 0.5 * (v_clip - returns).square()
    return torch.maximum(loss, loss_clip), (loss_clip > loss).to(loss.dtype)


def make_value_loss_fn(value_clip: float) -> ValueLossFn:
    """`value_loss_fn(mb, values [S]) -> (loss, metrics)` for MegatronCritic.update; needs
    mb.returns, and mb.old_values when value_clip > 0 (critic.value_clip; 0 = off)."""
    if value_clip < 0:
        raise ValueError(f"critic.value_clip={value_clip}: expected >= 0 (0 = off)")

    def value_loss_fn(mb: MicroBatch, values: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if mb.returns is None:
            raise ValueError(
                "MicroBatch.returns is None: attach the GAE returns (attach_per_sample(..., 'returns', ...)) "
                "before the critic update"
            )
        if value_clip > 0 and mb.old_values is None:
            raise ValueError(f"MicroBatch.old_values is None but critic.value_clip={value_clip}: attach the critic's "
                             "values before the update (attach_per_sample(..., 'old_values', ...))")
        mask = mb.loss_mask > 0

        def masked(x: torch.Tensor) -> torch.Tensor:
            # masked *before* the arithmetic: other positions may hold anything, and inf * 0 = nan
            # (in backward too: d/dV of 0 * (V - R)^2 at V = inf)
            x = x.to(values.dtype)
            return torch.where(mask, x, torch.zeros_like(x))

        v, returns = masked(values), masked(mb.returns)
        old = masked(mb.old_values) if mb.old_values is not None else None
        per_token, clipped = clipped_value_loss(v, old, returns, value_clip)
        loss = (masked(mb.loss_weight) * per_token).sum()
        m = mask.to(torch.float32)
        metrics = {
            "value_loss": loss.detach(),
            "values": v.detach().float().sum(),
            "returns": returns.float().sum(),
            "value_clipfrac": (clipped.float() * m).sum(),
            "n_tokens": m.sum(),
        }
        return loss, metrics

    return value_loss_fn


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[R - V] / Var[R] over the tokens where mask is set (population variances): 1 for a
    perfect critic, 0 for one that predicts the mean return, negative when worse than that.
    nan when there is no masked token or the returns are constant (Var[R] = 0: undefined)."""
    keep = mask.bool() if mask.dtype == torch.bool else mask > 0
    r = returns[keep].double()
    v = values[keep].double()
    if r.numel() == 0:
        return float("nan")
    var_r = r.var(unbiased=False)
    if float(var_r) == 0.0:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var_r)

"""Loss metrics that add up across micro-batches and DP ranks.

A loss function sees one micro-batch, but a metric is wanted for the whole RL step, and the split
into micro-batches and DP ranks must not change it (the same invariant as the loss). So every
metric a loss function returns is additive: a 0-dim tensor that is SUMMED over micro-batches and
DP ranks, except keys ending in "_max" (MAX) and "_min" (MIN). How to aggregate a step:

    combined = combine_loss_metrics(per_micro_batch_dicts)       # on each DP rank
    # across DP ranks: all_reduce each key with metric_reduction(key) (SUM / MAX / MIN)
    step = finalize_loss_metrics(combined)                      # -> dict[str, float]

Means are carried as numerator sums over loss tokens (or sequences) beside the counts "n_tokens"
and "n_seqs"; `finalize_loss_metrics` divides them after the reduction (plain token means,
independent of the loss aggregation mode). Keys without a denominator ("loss", "pg_loss",
"kl_loss", "entropy_loss") are already weighted by MicroBatch.loss_weight: their sums are the
step's values under the configured aggregation.
"""

from __future__ import annotations

from typing import Iterable, Literal, Mapping

import torch

# metric key -> the count key that divides it in finalize_loss_metrics
DENOMINATORS: dict[str, str] = {
    "ratio_mean": "n_tokens",              # mean PPO / GSPO ratio over loss tokens
    "clip_fraction": "n_tokens",           # fraction of loss tokens where the clipped term was chosen
    "clip_fraction_dual": "n_tokens",      # fraction where the dual-clip bound -c*A was active
    "approx_kl": "n_tokens",               # mean k3 estimate of KL(old || current policy)
    "kl": "n_tokens",                      # mean KL(pi || ref) estimate (configured estimator)
    "entropy": "n_tokens",                 # mean token entropy
    "mismatch/logprob_gap": "n_tokens",    # mean |old (trainer) - rollout (engine)| logprob
    "mismatch/k3_kl": "n_tokens",          # k3 estimate of KL(rollout || trainer)
    "mismatch/is_weight_mean": "n_tokens",  # mean importance weight applied to the policy loss
    "mismatch/clipped_frac": "n_tokens",   # TIS: fraction of tokens whose ratio was truncated at the cap
    "mismatch/masked_frac": "n_tokens",    # MIS: fraction of loss tokens masked out
    "mismatch/seq_masked_frac": "n_seqs",  # MIS seq: fraction of sequences masked out
    "values": "n_tokens",                  # critic: mean value over loss tokens (before this update's step)
    "returns": "n_tokens",                 # critic: mean GAE return (the regression target)
    "value_clipfrac": "n_tokens",          # critic: fraction of loss tokens where the clipped value loss was larger
    # DPO / IPO (mlrl.algorithms.dpo_loss): means over the step's preference pairs
    "chosen_reward": "n_pairs",            # beta * (log pi - log ref) of the chosen completions
    "rejected_reward": "n_pairs",          # the same for the rejected ones
    "reward_margin": "n_pairs",            # chosen minus rejected implicit reward
    "reward_accuracy": "n_pairs",          # share of pairs whose chosen reward is the higher
    "chosen_logprob": "n_pairs",           # policy log-probability of the chosen completion (IPO: per token)
    "rejected_logprob": "n_pairs",         # the same for the rejected one
    # reward-model training (mlrl.algorithms.rm_loss): means over the step's preference pairs
    "chosen_score": "n_pairs",             # the reward model's score of the chosen sequence
    "rejected_score": "n_pairs",           # the same for the rejected one
    "score_margin": "n_pairs",             # chosen minus rejected score
    "pair_accuracy": "n_pairs",            # share of pairs whose chosen score is the higher
}


def metric_reduction(key: str) -> Literal["sum", "max", "min"]:
    """How a key is reduced across micro-batches and DP ranks."""
    if key.endswith("_max"):
        return "max"
    if key.endswith("_min"):
        return "min"
    return "sum"


def combine_loss_metrics(metrics: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Reduce several loss-metric dicts (micro-batches, or ranks) into one, key by key."""
    out: dict[str, torch.Tensor] = {}
    for m in metrics:
        for k, v in m.items():
            v = v.detach().to(torch.float64)
            if k not in out:
                out[k] = v
            elif metric_reduction(k) == "max":
                out[k] = torch.maximum(out[k], v)
            elif metric_reduction(k) == "min":
                out[k] = torch.minimum(out[k], v)
            else:
                out[k] = out[k] + v
    return out


def finalize_loss_metrics(combined: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Turn reduced sums into step values: divide the mean-type keys by their counts.

    A mean whose count is 0 (e.g. no loss token in the step) and a max/min that saw no token
    (+-inf) are left out rather than reported as 0 or inf.
    """
    out: dict[str, float] = {}
    for k, v in combined.items():
        x = float(v)
        den = DENOMINATORS.get(k)
        if den is not None:
            d = float(combined.get(den, 0.0))
            if d <= 0:
                continue
            x /= d
        if x != x or x in (float("inf"), float("-inf")):
            continue
        out[k] = x
    return out

"""The step-wide loss normalisation that `MicroBatch.loss_weight` carries (algorithm.loss_agg).

It lives with the experience data, not with the losses, because the packer applies it once over
ALL samples of a step, before they are split into micro-batches and DP ranks: that is what makes
the loss and its gradients independent of the split. The loss functions
(mlrl.algorithms.losses) only sum loss_weight * per-token loss.
"""

from __future__ import annotations

from typing import Optional, Sequence

LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def loss_agg_weights(num_loss_tokens: Sequence[int], loss_agg: str, norm_len: Optional[int] = None) -> list[float]:
    """Per-sample weight c_i given to each loss token of sample i, over ALL samples of a step, so
    that the step loss is sum_i c_i * sum_{t in y_i} l_t. With |y_i| the loss tokens of sample i
    and n the number of samples that have at least one:

        token-mean               c_i = 1 / sum_j |y_j|
        seq-mean-token-mean      c_i = 1 / (n * |y_i|)
        seq-mean-token-sum       c_i = 1 / n
        seq-mean-token-sum-norm  c_i = 1 / (n * L)

    L is the constant length of Dr.GRPO (Liu et al. 2025): pass norm_len = the generation budget
    (rollout.sampling.max_new_tokens) to get the paper's objective, which does not depend on the
    batch; norm_len=None uses the longest |y_i| of the step instead. Samples without loss tokens
    get 0.
    """
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"algorithm.loss_agg={loss_agg!r}: expected one of {LOSS_AGG_MODES}")
    if norm_len is not None and norm_len <= 0:
        raise ValueError(f"norm_len={norm_len}: expected a positive token count (or None)")
    counts = [int(c) for c in num_loss_tokens]
    if any(c < 0 for c in counts):
        raise ValueError(f"num_loss_tokens={counts}: expected counts >= 0")
    n = sum(1 for c in counts if c > 0)
    if n == 0:
        return [0.0] * len(counts)
    if loss_agg == "token-mean":
        total = sum(counts)
        return [1.0 / total if c else 0.0 for c in counts]
    if loss_agg == "seq-mean-token-mean":
        return [1.0 / (n * c) if c else 0.0 for c in counts]
    if loss_agg == "seq-mean-token-sum":
        return [1.0 / n if c else 0.0 for c in counts]
    length = norm_len if norm_len is not None else max(counts)
    return [1.0 / (n * length) if c else 0.0 for c in counts]

"""The supervised fine-tuning loss (pure torch): negative log-likelihood of the trained tokens.

`MicroBatch.loss_weight` carries the token-mean normalisation over the whole step (loss_mask /
the step's loss tokens, `loss_agg="token-mean"` in the packer), so summing this loss over
micro-batches and DP ranks gives the step's mean NLL per assistant token: what Hugging Face's
causal-LM loss computes on the same tokens (labels -100 elsewhere).
"""

from __future__ import annotations

import torch

from mlrl.experience.batch import MicroBatch


def sft_loss(mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of one micro-batch; `logprobs` [S] of each token given the ones before it."""
    loss = -(mb.loss_weight * logprobs).sum()
    return loss, {"n_tokens": mb.loss_mask.sum(), "entropy": (mb.loss_mask * entropy).sum().detach()}

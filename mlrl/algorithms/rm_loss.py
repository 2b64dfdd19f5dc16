"""Reward-model training (pure torch): the Bradley-Terry pairwise loss (Ouyang et al. 2022, as
TRL's RewardTrainer and NeMo-RL's RM training use it).

A reward model maps a sequence (prompt + completion) to one score r: its scalar head's output at
the sequence's last token. For a pair (chosen y_w, rejected y_l) of one prompt:

    loss = -log sigmoid(r_w - r_l)  [+ center_rewards_coefficient * (r_w + r_l)^2]

and the step loss is the mean over the step's pairs. The pairwise term fixes only score
differences; the optional centring term (Eisenstein et al. 2023, TRL's `center_rewards_coefficient`)
pulls the scores toward mean 0. Reported (means over pairs): `chosen_score`, `rejected_score`,
`score_margin` and `pair_accuracy`, the share of pairs whose chosen score is the higher.

Packing contract (`mlrl.jobs.rm`, the same as DPO's: `mlrl.jobs.dpo.pack_pairs`): the step's
samples are [chosen_0, rejected_0, chosen_1, ...], each pair whole in one micro-batch, with loss_agg
"seq-mean-token-sum": every completion token carries loss_weight 1 / (2 * pairs), a pair 1 / pairs, so the
micro-batch losses add up to the step's mean over pairs whatever the split. The loss function gets
the per-position scores [S] of the micro-batch (`MegatronRewardModel._token_values`: position t =
the score of the sequence up to and including token t).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from mlrl.algorithms.dpo_loss import _per_sample
from mlrl.experience.batch import MicroBatch

PAIR_SUMS = ("chosen_score", "rejected_score", "score_margin", "pair_accuracy")  # divided by n_pairs after the step

RMLossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict]]


def sequence_scores(mb: MicroBatch, position_scores: torch.Tensor) -> torch.Tensor:
    """The score of each segment of the micro-batch: the per-position score at its last token."""
    cu = mb.cu_seqlens.long()
    return position_scores[cu[1:] - 1]


def pair_loss(chosen: torch.Tensor, rejected: torch.Tensor, center_coef: float = 0.0) -> torch.Tensor:
    """Per-pair loss: -log sigmoid(r_w - r_l) + center_coef * (r_w + r_l)^2."""
    loss = -F.logsigmoid(chosen - rejected)
    if center_coef:
        loss = loss + center_coef * (chosen + rejected) ** 2
    return loss


def make_rm_loss_fn(center_rewards_coefficient: float = 0.0) -> RMLossFn:
    """The trainer's loss function for a reward-model step (see the module docstring)."""
    if not center_rewards_coefficient >= 0:
        raise ValueError(f"rm.center_rewards_coefficient={center_rewards_coefficient}: expected >= 0")

    def rm_loss(mb: MicroBatch, scores: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(loss, metrics): the pair sums of PAIR_SUMS and n_pairs."""
        if mb.prefix_segment is not None:
            raise ValueError("reward-model micro-batches are packed without shared prefixes")
        if mb.num_samples == 0:  # a padding-only micro-batch (a DP rank with fewer pairs): every key, at 0
            zero = scores.sum() * 0.0
            z = zero.detach()
            return zero, {"n_pairs": z, **{k: z for k in PAIR_SUMS}}
        ids, count, (w,) = _per_sample(mb, mb.loss_weight)
        if ids.numel() % 2 or bool((ids[0::2] % 2 != 0).any()) or bool((ids[1::2] != ids[0::2] + 1).any()):
            raise ValueError(f"a reward-model micro-batch must hold whole (chosen, rejected) pairs in order; "
                             f"sample ids {ids.tolist()[:8]}")
        if bool((count == 0).any()):
            raise ValueError("a reward-model sample without completion tokens (loss_mask all 0)")
        r = sequence_scores(mb, scores).float()
        rc, rr = r[0::2], r[1::2]
        # a token's weight is 1 / (2 * pairs in the step): a sample's mean weight is 1 / (2 pairs), a pair's 1 / pairs
        pair_w = (w[0::2] / count[0::2] + w[1::2] / count[1::2]).detach()
        loss = (pair_w * pair_loss(rc, rr, center_rewards_coefficient)).sum()
        rc, rr = rc.detach(), rr.detach()
        return loss, {"n_pairs": torch.tensor(float(rc.numel())), "chosen_score": rc.sum(),
                      "rejected_score": rr.sum(), "score_margin": (rc - rr).sum(),
                      "pair_accuracy": (rc > rr).float().sum()}

    return rm_loss

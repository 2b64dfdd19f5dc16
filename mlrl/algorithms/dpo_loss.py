"""Direct preference optimisation (pure torch): DPO (Rafailov et al. 2023) and IPO (Azar et al. 2023).

For a pair (chosen y_w, rejected y_l) of one prompt x, with log-probabilities summed over each
completion's tokens under the policy (pi) and the frozen reference (ref):

    h = [log pi(y_w|x) - log ref(y_w|x)] - [log pi(y_l|x) - log ref(y_l|x)]
    sigmoid (DPO):  loss = -log sigmoid(beta * h)
    ipo (IPO):      loss = (h - 1 / (2 beta))^2, with each log-probability the MEAN over the
                    completion's tokens (TRL's IPO; the paper's length-normalised form)

and the step loss is the mean over the step's pairs. The implicit rewards beta * [log pi - log ref]
of each side are reported (`chosen_reward`, `rejected_reward`, their difference `reward_margin`,
and `reward_accuracy`, the share of pairs whose chosen reward is higher).

Packing contract (`mlrl.jobs.dpo`): the step's samples are [chosen_0, rejected_0, chosen_1, ...]
(sample id 2k chosen, 2k + 1 rejected), each pair packed whole into one micro-batch
(`pack_step(whole_groups=True)`), with loss_agg "seq-mean-token-sum": every completion token of
the step carries loss_weight 1 / (2 * pairs), so a pair's weight is the sum of its two samples'
weights, 1 / pairs, and the micro-batch losses add up to the step's mean over pairs whatever the
split. `MicroBatch.ref_logprobs` holds the reference's token logprobs.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
import torch.nn.functional as F

from mlrl.experience.batch import MicroBatch

DPOLossType = Literal["sigmoid", "ipo"]
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo")


def pair_loss(h: torch.Tensor, beta: float, loss_type: str) -> torch.Tensor:
    """Per-pair loss from h (log-ratio of chosen minus log-ratio of rejected)."""
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * h)
    if loss_type == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    raise ValueError(f"dpo.loss_type={loss_type!r}: expected one of {DPO_LOSS_TYPES}")


def _per_sample(mb: MicroBatch, *values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(sample ids [n], loss-token counts [n], per-sample sums of each value over loss tokens) for
    the micro-batch's n segments."""
    cu = mb.cu_seqlens.long()
    n = int(cu.numel() - 1)
    real = int(cu[-1])
    seg = torch.repeat_interleave(torch.arange(n, device=cu.device), cu[1:] - cu[:-1])
    mask = mb.loss_mask[:real]
    count = torch.zeros(n, dtype=mask.dtype, device=mask.device).index_add(0, seg, mask)
    sums = [torch.zeros(n, dtype=v.dtype, device=v.device).index_add(0, seg, v[:real] * mask) for v in values]
    return mb.sample_ids[cu[:-1]], count, sums


_PAIR_SUMS = ("chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy", "chosen_logprob",
              "rejected_logprob")  # the per-pair metrics, summed (divided by n_pairs after the step)


def make_dpo_loss_fn(beta: float, loss_type: str) -> Callable[[MicroBatch, torch.Tensor, torch.Tensor],
                                                               tuple[torch.Tensor, dict]]:
    """The trainer's loss function for a DPO / IPO step (see the module docstring)."""
    if beta <= 0:
        raise ValueError(f"dpo.beta={beta}: expected > 0")
    pair_loss(torch.zeros(1), beta, loss_type)  # unknown loss types fail here, before any step

    def dpo_loss(mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(loss, metrics): the pair sums of _PAIR_SUMS, n_pairs, n_tokens, entropy."""
        if mb.prefix_segment is not None:
            raise ValueError("DPO micro-batches are packed without shared prefixes")
        ent = (mb.loss_mask * entropy).sum().detach()
        if mb.num_samples == 0:  # a padding-only micro-batch (a DP rank with fewer pairs): every key, at 0,
            zero = logprobs.sum() * 0.0   # so that each micro-batch and DP rank reduces the same set
            z = zero.detach()
            return zero, {"n_tokens": mb.loss_mask.sum(), "entropy": ent, "n_pairs": z, **{k: z for k in _PAIR_SUMS}}
        if mb.ref_logprobs is None:
            raise ValueError("a DPO micro-batch needs the reference's logprobs (MicroBatch.ref_logprobs)")
        ids, count, (pol, ref, w) = _per_sample(mb, logprobs, mb.ref_logprobs, mb.loss_weight)
        if ids.numel() % 2 or bool((ids[0::2] % 2 != 0).any()) or bool((ids[1::2] != ids[0::2] + 1).any()):
            raise ValueError(f"a DPO micro-batch must hold whole (chosen, rejected) pairs in order; sample ids "
                             f"{ids.tolist()[:8]}")
        if bool((count == 0).any()):
            raise ValueError("a DPO sample without completion tokens (loss_mask all 0)")
        if loss_type == "ipo":
            pol, ref = pol / count, ref / count
        ratio = pol - ref
        h = ratio[0::2] - ratio[1::2]
        # weight of a token = 1 / (2 * pairs): a sample's weights sum to count / (2 pairs)
        pair_w = (w[0::2] / count[0::2] + w[1::2] / count[1::2]).detach()
        loss = (pair_w * pair_loss(h, beta, loss_type)).sum()
        rc, rr = (beta * ratio[0::2]).detach(), (beta * ratio[1::2]).detach()
        return loss, {
            "n_tokens": mb.loss_mask.sum(), "entropy": ent, "n_pairs": torch.tensor(float(h.numel())),
            "chosen_reward": rc.sum(), "rejected_reward": rr.sum(), "reward_margin": (rc - rr).sum(),
            "reward_accuracy": (rc > rr).float().sum(), "chosen_logprob": pol[0::2].detach().sum(),
            "rejected_logprob": pol[1::2].detach().sum(),
        }

    return dpo_loss

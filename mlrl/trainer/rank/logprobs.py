"""Token logprobs and entropy from vocab-parallel logits, with the sampler's temperature.

Temperature is applied as vLLM's sampler does: logits / T (in fp32) before the softmax, so the
trainer's logprobs are those of the distribution tokens were sampled from. T = 0 (greedy) has no
such distribution; it is treated as T = 1 (the model's own distribution).

Each TP rank holds a vocabulary slice [S, V/tp] of the logits (Megatron's vocab padding rows
are dropped here, never counted in the partition function). The log-partition, the target
logit and sum_v p_v z_v are sums over the vocabulary: each rank computes its partial sum and
`reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward) completes
it, which is exactly the gradient of the replicated loss w.r.t. each rank's slice. The max
used for stability is detached (log-sum-exp is invariant to it).

    logprob[p] = z[p, label[p]] - logZ[p],  entropy[p] = logZ[p] - sum_v softmax(z[p])_v z[p, v]
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float, vocab_size: int,
                            tp_rank: int, tp_size: int, tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V/tp] (this rank's slice), labels [S] global ids -> (logprob [S], entropy [S])
    of the prediction made at each position."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    t = temperature if temperature > 0 else 1.0
    shard = logits.shape[-1]
    lo = tp_rank * shard
    valid = max(0, min(shard, vocab_size - lo))
    z = logits[..., :valid].float()
    if t != 1.0:
        z = z / t
    if valid:
        m = z.max(dim=-1).values.detach()
    else:  # this rank holds only vocabulary padding
        m = torch.full(z.shape[:-1], -float("inf"), device=z.device)
    if tp_size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    if valid:
        zs = z - m.unsqueeze(-1)
        e = zs.exp()
        local = labels - lo
        in_shard = (local >= 0) & (local < valid)
        picked = zs.gather(-1, local.clamp(0, valid - 1).unsqueeze(-1)).squeeze(-1) * in_shard
        sums = torch.stack([e.sum(-1), (e * zs).sum(-1), picked], dim=0)
    else:
        # keep the graph connected to the logits: backward must run on every TP rank, since
        # the layers below have TP collectives in their backward
        zero = logits.float().sum(-1) * 0.0
        sums = torch.stack([zero, zero, zero], dim=0)
    if tp_size > 1:
        sums = reduce_from_tensor_model_parallel_region(sums, group=tp_group)
    sum_e, sum_ez, target = sums[0], sums[1], sums[2]
    log_z = sum_e.log()
    logprob = target - log_z
    entropy = log_z - sum_ez / sum_e
    return logprob, entropy


def align_to_tokens(next_values: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """values of the prediction made at p (for token p+1) -> values indexed by token t (made at
    t-1); positions without a prediction (first token of a sample, padding) get 0."""
    v = torch.where(label_mask, next_values, torch.zeros_like(next_values))
    return torch.cat([v.new_zeros(1), v[:-1]])

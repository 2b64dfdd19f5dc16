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

The pass is one autograd function over row chunks (`_LogprobEntropy`), so that no full
[S, V/tp] fp32 tensor exists at any time: the forward reads the logits (bf16 on GPU) a chunk of
rows at a time in fp32 and keeps per-row statistics only; the backward recomputes each chunk's
softmax from the saved logits and writes the gradient straight into a tensor of the logits'
dtype:

    d logprob[p] / d z[p, k] = 1[k = label[p]] - p_k
    d entropy[p] / d z[p, k] = -p_k (z[p, k] - logZ[p] + entropy[p])

(and d z = d logits / T). On GPU both passes are Triton kernels that read the logits once
(mlrl.trainer.rank.logprob_kernels); on CPU they are torch ops over row chunks. Autograd of the
plain formula kept five fp32 [S, V/tp] tensors per micro-batch for the backward (1.2 GB each
at 2048 tokens and a 150k vocabulary). Everything runs
on the logits' device with no host synchronisation; the TP reductions are all-reduces of [S]
and [3, S] tensors. Each rank's gradient is that of the replicated loss with respect to its own
vocabulary slice (the global logZ and entropy are known after the forward's reductions), which
is what `reduce_from_tensor_model_parallel_region` (identity backward) gave before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mlrl.trainer.rank import logprob_kernels

# fp32 elements of one chunk's temporaries (2^25 = 128 MB each): rows per chunk = this / (V/tp)
CHUNK_ELEMENTS = 1 << 25


def _rows_per_chunk(valid: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, valid))


class _LogprobEntropy(torch.autograd.Function):
    """(logits [S, V/tp] slice, labels [S]) -> (logprob [S], entropy [S]); see the module doc."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, t: float, lo: int, valid: int,
                tp_size: int, tp_group: Any) -> tuple[torch.Tensor, torch.Tensor]:
        S = logits.shape[0]
        dev = logits.device
        ctx.t, ctx.lo, ctx.valid = t, lo, valid
        if logprob_kernels.available(logits):
            return _LogprobEntropy._forward_kernel(ctx, logits, labels, t, lo, valid, tp_size, tp_group)
        acc = torch.promote_types(logits.dtype, torch.float32)  # fp32 (fp64 stays fp64: gradcheck)
        if valid:
            x = logits[:, :valid]
            m = x.max(dim=-1).values.to(acc)  # max of bf16 values is exact in fp32; /T keeps the order
            if t != 1.0:
                m = m / t
        else:  # this rank holds only vocabulary padding
            m = torch.full((S,), -float("inf"), dtype=acc, device=dev)
        if tp_size > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
        sums = torch.zeros(3, S, dtype=acc, device=dev)  # sum_e, sum_ez, target (shifted by m)
        local = labels - lo
        in_shard = (local >= 0) & (local < valid)
        if valid:
            idx = local.clamp(0, valid - 1)
            step = _rows_per_chunk(valid)
            for a in range(0, S, step):
                b = min(S, a + step)
                z = logits[a:b, :valid].to(acc)
                if t != 1.0:
                    z = z / t
                zs = z - m[a:b].unsqueeze(-1)
                e = zs.exp()
                sums[0, a:b] = e.sum(-1)
                sums[1, a:b] = (e * zs).sum(-1)
                sums[2, a:b] = zs.gather(-1, idx[a:b].unsqueeze(-1)).squeeze(-1) * in_shard[a:b]
        if tp_size > 1:
            dist.all_reduce(sums, group=tp_group)
        log_z = sums[0].log()
        logprob = sums[2] - log_z
        entropy = log_z - sums[1] / sums[0]
        ctx.save_for_backward(logits, labels, m + log_z, entropy)  # logZ of the unshifted z
        return logprob, entropy

    @staticmethod
    def _forward_kernel(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, t: float, lo: int, valid: int,
                        tp_size: int, tp_group: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """GPU: one Triton pass per row gives (m, s = sum e^(z-m), w = sum e^(z-m) z, target);
        the ranks' partial sums are rescaled to the global max before they are added."""
        S = logits.shape[0]
        if valid:
            m, s, w, target = logprob_kernels.row_stats(logits, labels, lo=lo, valid=valid, t=t)
        else:
            m = torch.full((S,), -float("inf"), dtype=torch.float32, device=logits.device)
            s = w = target = torch.zeros(S, dtype=torch.float32, device=logits.device)
        big_m = m.clone()
        if tp_size > 1:
            dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=tp_group)
        scale = (m - big_m).exp()  # 0 on a rank without vocabulary (m = -inf)
        sums = torch.stack([s * scale, w * scale, target])
        if tp_size > 1:
            dist.all_reduce(sums, group=tp_group)
        log_z = big_m + sums[0].log()
        logprob = sums[2] - log_z
        entropy = log_z - sums[1] / sums[0]
        ctx.save_for_backward(logits, labels, log_z, entropy)
        return logprob, entropy

    @staticmethod
    def backward(  # pyright: ignore[reportIncompatibleMethodOverride]  # one gradient per output of forward
            ctx: Any, g_lp: torch.Tensor, g_ent: torch.Tensor) -> tuple[Any, ...]:
        logits, labels, log_z, entropy = ctx.saved_tensors
        t, lo, valid = ctx.t, ctx.lo, ctx.valid
        if not valid:
            return torch.zeros_like(logits), None, None, None, None, None, None
        S = logits.shape[0]
        acc = log_z.dtype
        g_lp = g_lp.to(acc) if g_lp is not None else torch.zeros(S, dtype=acc, device=logits.device)
        g_ent = g_ent.to(acc) if g_ent is not None else torch.zeros(S, dtype=acc, device=logits.device)
        shift = log_z - entropy  # z - logZ + H = z - (logZ - H)
        if logprob_kernels.available(logits):
            grad = logprob_kernels.grad(logits, labels, log_z, shift, g_lp, g_ent, lo=lo, valid=valid, t=t)
            return grad, None, None, None, None, None, None
        grad = torch.zeros_like(logits)
        local = labels - lo
        in_shard = (local >= 0) & (local < valid)
        idx = local.clamp(0, valid - 1)
        step = _rows_per_chunk(valid)
        for a in range(0, S, step):
            b = min(S, a + step)
            z = logits[a:b, :valid].to(acc, copy=True)  # a chunk of our own: updated in place below
            if t != 1.0:
                z.div_(t)
            p = (z - log_z[a:b].unsqueeze(-1)).exp_()
            # dz = -p (g_lp + g_ent (z - shift)) + g_lp 1[label], in place on the chunk
            dz = z.sub_(shift[a:b].unsqueeze(-1)).mul_(g_ent[a:b].unsqueeze(-1)).add_(g_lp[a:b].unsqueeze(-1))
            dz.mul_(p).neg_()
            dz.scatter_add_(-1, idx[a:b].unsqueeze(-1), (g_lp[a:b] * in_shard[a:b]).unsqueeze(-1))
            if t != 1.0:
                dz.div_(t)
            grad[a:b, :valid] = dz
        return grad, None, None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float, vocab_size: int,
                            tp_rank: int, tp_size: int, tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V/tp] (this rank's slice), labels [S] global ids -> (logprob [S], entropy [S])
    of the prediction made at each position."""
    t = temperature if temperature > 0 else 1.0
    shard = logits.shape[-1]
    lo = tp_rank * shard
    valid = max(0, min(shard, vocab_size - lo))
    return _LogprobEntropy.apply(logits, labels, t, lo, valid, tp_size, tp_group)


def align_to_tokens(next_values: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """values of the prediction made at p (for token p+1) -> values indexed by token t (made at
    t-1); positions without a prediction (first token of a sample, padding) get 0."""
    v = torch.where(label_mask, next_values, torch.zeros_like(next_values))
    return torch.cat([v.new_zeros(1), v[:-1]])

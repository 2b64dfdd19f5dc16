"""Triton kernels of the logprob / entropy pass on GPU (mlrl.trainer.rank.logprobs).

Why by hand: the pass is memory-bound, and each separate elementwise op of the plain formula reads
or writes the whole [S, V/tp] logits again in fp32 (a profile on an H100 found ~55 ms of 212 in
such kernels for one forward-only call at 2048 tokens). Neither Megatron's fused vocab-parallel
cross-entropy (no entropy, no temperature) nor TE's (the same) gives what the RL losses need,
so these two kernels read the bf16 logits once each:

- `row_stats`: per row of this rank's vocabulary slice, in one pass with an online max:
  m = max z, s = sum exp(z - m), w = sum exp(z - m) z, and the target logit z[label] (0 when the
  label is in another rank's slice), z = logits / T in fp32.
- `grad`: per (row, vocabulary block), the gradient of `g_lp * logprob + g_ent * entropy`:
  dz_k = g_lp (1[k = label] - p_k) - g_ent p_k (z_k - logZ + entropy), d logits = dz / T.

The TP reductions of the row statistics happen in torch (mlrl.trainer.rank.logprobs). Tested on
CPU through Triton's interpreter (TRITON_INTERPRET=1) against the torch path, and on GPU by
tests/gpu/trainer.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
except ImportError:  # pragma: no cover - CPU images without triton use the torch path
    triton = None

BLOCK = 4096  # vocabulary columns per program step (bf16: 8 KB per row block)


# Triton's interpreter (TRITON_INTERPRET=1, read when the kernels are defined) runs them on CPU
# tensors: how the unit tests check them on machines without a GPU
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def available(logits: torch.Tensor) -> bool:
    """The kernels apply to CUDA tensors when Triton is importable (and to any tensor under the
    interpreter)."""
    return triton is not None and (logits.is_cuda or _INTERPRETED)


if triton is not None:
    import triton.language as tl  # loaded by `import triton` already

    @triton.jit
    def _row_stats_kernel(x_ptr, stride, labels_ptr, m_ptr, s_ptr, w_ptr, tgt_ptr, valid, lo, inv_t,
                          BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * stride
        label = tl.load(labels_ptr + row) - lo
        m = tl.full((), -float("inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        w = tl.zeros((), tl.float32)
        tgt = tl.zeros((), tl.float32)
        for start in range(0, valid, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < valid
            z = tl.load(base + cols, mask=inside, other=-float("inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(z, 0))
            scale = tl.exp(m - m_new)
            e = tl.where(inside, tl.exp(z - m_new), 0.0)
            s = s * scale + tl.sum(e, 0)
            w = w * scale + tl.sum(e * tl.where(inside, z, 0.0), 0)
            tgt += tl.sum(tl.where((cols == label) & inside, z, 0.0), 0)
            m = m_new
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        tl.store(w_ptr + row, w)
        tl.store(tgt_ptr + row, tgt)

    @triton.jit
    def _grad_kernel(x_ptr, g_ptr, stride, labels_ptr, logz_ptr, shift_ptr, glp_ptr, gent_ptr, valid, lo, inv_t,
                     BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < valid
        off = row.to(tl.int64) * stride
        z = tl.load(x_ptr + off + cols, mask=inside, other=0.0).to(tl.float32) * inv_t
        log_z = tl.load(logz_ptr + row)
        shift = tl.load(shift_ptr + row)
        g_lp = tl.load(glp_ptr + row)
        g_ent = tl.load(gent_ptr + row)
        label = tl.load(labels_ptr + row) - lo
        p = tl.exp(z - log_z)
        dz = -p * (g_lp + g_ent * (z - shift)) + tl.where((cols == label) & inside, g_lp, 0.0)
        tl.store(g_ptr + off + cols, (dz * inv_t).to(g_ptr.dtype.element_ty), mask=inside)


def row_stats(logits: torch.Tensor, labels: torch.Tensor, *, lo: int, valid: int,
              t: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, s, w, target) [S] fp32 of this rank's slice (see the module doc); valid > 0."""
    assert logits.stride(-1) == 1, "logits rows must be contiguous"
    S = logits.shape[0]
    out = [torch.empty(S, dtype=torch.float32, device=logits.device) for _ in range(4)]
    if S:
        _row_stats_kernel[(S,)](logits, logits.stride(0), labels, out[0], out[1], out[2], out[3], valid, lo, 1.0 / t,
                                BLOCK=BLOCK)  # pyright: ignore[reportArgumentType]  # an int for a tl.constexpr
    return out[0], out[1], out[2], out[3]


def grad(logits: torch.Tensor, labels: torch.Tensor, log_z: torch.Tensor, shift: torch.Tensor, g_lp: torch.Tensor,
         g_ent: torch.Tensor, *, lo: int, valid: int, t: float) -> torch.Tensor:
    """d(sum g_lp * logprob + g_ent * entropy) / d logits, in the logits' dtype (padding columns 0)."""
    assert logits.stride(-1) == 1, "logits rows must be contiguous"
    out = torch.zeros_like(logits)
    assert out.stride() == logits.stride()
    S = logits.shape[0]
    if S and valid:
        assert triton is not None, "grad needs Triton (see available)"
        grid = (S, triton.cdiv(valid, BLOCK))
        _grad_kernel[grid](logits, out, logits.stride(0), labels, log_z.contiguous(), shift.contiguous(),
                           g_lp.contiguous(), g_ent.contiguous(), valid, lo, 1.0 / t,
                           BLOCK=BLOCK)  # pyright: ignore[reportArgumentType]  # an int for a tl.constexpr
    return out

"""RoPE on packed (THD) sequences in one gather instead of a Python loop over the sequences.

Megatron-Core's unfused THD path (`rope_utils._apply_rotary_pos_emb_thd`, used on CPU and
whenever fused RoPE is off, e.g. yarn) builds the per-token frequencies by splitting the packed
tensor into its sequences and slicing `freqs` once per sequence, for q and for k of every layer.
An RL micro-batch packs hundreds of short samples: on the CPU demo (512 samples per step) that
loop was 15% of the trainer's busy time (py-spy). Without context parallelism the per-token
frequency is simply `freqs[position within its sequence]`, so this gathers them with one index
and hands the result to the same `_apply_rotary_pos_emb_bshd` megatron calls: the same values in
the same operation, hence bit-identical outputs (tests/integration/trainer checks parity and the
unit test compares with megatron's own function). With context parallelism (cp > 1, GPU) the
original runs.
"""

from __future__ import annotations

import torch

_ORIGINAL = None


def _positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every packed token within its own sequence: [total] int64."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    return torch.arange(total, device=cu_seqlens.device) - torch.repeat_interleave(starts, lengths)


def apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, rotary_interleaved: bool = False,
                             multi_latent_attention: bool = False, mscale: float = 1.0, cp_group=None):
    """Drop-in for megatron's `_apply_rotary_pos_emb_thd` (same signature and result)."""
    from megatron.core.models.common.embeddings import rope_utils

    if cp_group is None or cp_group.size() != 1 or int(cu_seqlens[-1]) != t.size(0):
        return _ORIGINAL(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                         multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
    if freqs.size(0) == t.size(0):  # megatron's "exact mapping": freqs already per packed token
        packed = freqs
    else:
        packed = freqs[_positions(cu_seqlens, t.size(0))]
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed, rotary_interleaved=rotary_interleaved,
                                                 multi_latent_attention=multi_latent_attention,
                                                 mscale=mscale).squeeze(1)


def install() -> None:
    """Route megatron's THD RoPE through `apply_rotary_pos_emb_thd` (idempotent)."""
    global _ORIGINAL
    from megatron.core.models.common.embeddings import rope_utils

    if _ORIGINAL is None:
        _ORIGINAL = rope_utils._apply_rotary_pos_emb_thd
        rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd

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

The packed cos / sin tables are the same for q and k of every layer of one forward (megatron
passes one `freqs` tensor and one `cu_seqlens` to them all), so they are computed once and kept
until another forward's tensors arrive. Every call but a forward's first then skips the 8
operations that build them (positions, gather, cos, sin, scaling) and the copy megatron makes by
concatenating an empty pass-through part, leaving the 5 that rotate.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

_ORIGINAL: Optional[Callable[..., torch.Tensor]] = None  # megatron's, once installed


def _positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every packed token within its own sequence: [total] int64. A row packed with
    shared prefixes carries them (`mlrl_positions`, trainer/rank/inputs.py): a response's
    segment continues its prompt's positions instead of restarting at 0."""
    given = getattr(cu_seqlens, "mlrl_positions", None)
    if given is not None:
        return given
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    return torch.arange(total, device=cu_seqlens.device) - torch.repeat_interleave(starts, lengths)


def apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, rotary_interleaved: bool = False,
                             multi_latent_attention: bool = False, mscale: float = 1.0, cp_group=None):
    """Drop-in for megatron's `_apply_rotary_pos_emb_thd` (same signature and result)."""
    from megatron.core.models.common.embeddings import rope_utils

    shared = getattr(cu_seqlens, "mlrl_positions", None) is not None
    if cp_group is None or cp_group.size() != 1 or int(cu_seqlens[-1]) != t.size(0):
        if shared:
            raise ValueError("RoPE of a shared-prefix row (trainer.shared_prefix_packing) needs cp=1 and segments "
                             "covering the row")
        assert _ORIGINAL is not None, "packed_rope.install() first"
        return _ORIGINAL(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                         multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
    if multi_latent_attention:
        packed = freqs if freqs.size(0) == t.size(0) and not shared else freqs[_positions(cu_seqlens, t.size(0))]
        return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed, rotary_interleaved=rotary_interleaved,
                                                     multi_latent_attention=True, mscale=mscale).squeeze(1)
    # `_apply_rotary_pos_emb_bshd`'s operations, in its order, on the cached tables
    cos_, sin_ = _tables(freqs, cu_seqlens, t.size(0), mscale, t.dtype)
    x = t.unsqueeze(1)
    rot_dim = cos_.shape[-1]
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    out = (rot * cos_) + (rope_utils._rotate_half(rot, rotary_interleaved) * sin_)
    if rest.shape[-1]:
        out = torch.cat((out, rest), dim=-1)
    return out.squeeze(1)


_TABLES: dict[str, Any] = {"freqs": None, "cu_seqlens": None, "key": None, "tables": None}


def _tables(freqs: torch.Tensor, cu_seqlens: torch.Tensor, total: int, mscale: float,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of every packed token, [total, 1, 1, rot_dim], as megatron computes them; one
    entry, keyed by the identity (and in-place version) of the forward's freqs and cu_seqlens."""
    key = (freqs._version, cu_seqlens._version, total, mscale, dtype)
    if _TABLES["freqs"] is freqs and _TABLES["cu_seqlens"] is cu_seqlens and _TABLES["key"] == key:
        return _TABLES["tables"]
    whole = freqs.size(0) == total and getattr(cu_seqlens, "mlrl_positions", None) is None
    packed = freqs if whole else freqs[_positions(cu_seqlens, total)]
    tables = ((torch.cos(packed) * mscale).to(dtype), (torch.sin(packed) * mscale).to(dtype))
    _TABLES.update(freqs=freqs, cu_seqlens=cu_seqlens, key=key, tables=tables)
    return tables


def install() -> None:
    """Route megatron's THD RoPE through `apply_rotary_pos_emb_thd` (idempotent)."""
    global _ORIGINAL
    from megatron.core.models.common.embeddings import rope_utils

    if _ORIGINAL is None:
        _ORIGINAL = rope_utils._apply_rotary_pos_emb_thd
        rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd

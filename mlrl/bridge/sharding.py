"""How a full (unsharded) Megatron tensor is laid out across TP ranks, PP stages and EP ranks.

Pure torch, no megatron import. The invariants (tested round trip, bit-exact):
- `unshard([shard(t, rule, r, n) for r in range(n)], rule, ...) == t` for every rule;
- TP rules follow Megatron-Core's layers: ColumnParallelLinear splits dim 0, RowParallelLinear
  dim 1, VocabParallelEmbedding / the output layer split the vocabulary (dim 0) after padding it
  to `padded_vocab_size` with zero rows, and a gated MLP's fused fc1 `[gate; up]` is split so
  that rank r holds `[gate_r; up_r]` (Megatron's GLU layout under TP);
- pipeline stages own contiguous layer ranges (Megatron's offsets, VPP chunks interleaved);
- expert-parallel rank r owns experts [r * E/ep, (r+1) * E/ep).
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch

from mlrl.bridge.arch import BridgeError, ModelArch

TPRule = Literal["replicated", "column", "row", "vocab", "glu"]


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's vocabulary padding: round up to a multiple of divisible_by * tp."""
    m = divisible_by * tp
    return ((vocab_size + m - 1) // m) * m


def shard(full: torch.Tensor, rule: TPRule, rank: int, size: int, *, padded_rows: Optional[int] = None) -> torch.Tensor:
    """The part of `full` that TP rank `rank` of `size` holds."""
    if rule == "replicated" or size == 1 and rule != "vocab":
        return full
    if rule == "column":
        return full.chunk(size, dim=0)[rank] if full.shape[0] % size == 0 else _indivisible(full, 0, size)
    if rule == "row":
        return full.chunk(size, dim=1)[rank] if full.shape[1] % size == 0 else _indivisible(full, 1, size)
    if rule == "vocab":
        rows = padded_rows if padded_rows is not None else full.shape[0]
        if rows < full.shape[0] or rows % size:
            raise BridgeError(f"padded vocabulary {rows} must be >= {full.shape[0]} and divisible by tp={size}")
        per = rows // size
        out = full.new_zeros((per, *full.shape[1:]))
        lo, hi = rank * per, min((rank + 1) * per, full.shape[0])
        if hi > lo:
            out[: hi - lo] = full[lo:hi]
        return out
    if rule == "glu":
        gate, up = full.chunk(2, dim=0)
        if gate.shape[0] % size:
            _indivisible(gate, 0, size)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    raise BridgeError(f"unknown TP rule {rule!r}")


def unshard(shards: Sequence[torch.Tensor], rule: TPRule, *, rows: Optional[int] = None) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every rank's part, in rank order.
    `rows` (vocab rule) drops the padding rows."""
    if rule == "replicated" or len(shards) == 1 and rule != "vocab":
        return shards[0]
    if rule == "column":
        return torch.cat(list(shards), dim=0)
    if rule == "row":
        return torch.cat(list(shards), dim=1)
    if rule == "vocab":
        full = torch.cat(list(shards), dim=0)
        return full[:rows] if rows is not None else full
    if rule == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)], dim=0)
    raise BridgeError(f"unknown TP rule {rule!r}")


def _indivisible(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    raise BridgeError(f"tensor of shape {tuple(t.shape)} cannot be split {size} ways along dim {dim}")


def stage_layers(num_layers: int, pp: int, pp_rank: int, *, vpp: Optional[int] = None, vp_stage: Optional[int] = None,
                 split: Optional[Sequence[int]] = None) -> list[int]:
    """Global indices of the decoder layers held by pipeline rank `pp_rank` (VPP chunk `vp_stage`).

    Even split (Megatron's default): chunk c of stage r holds layers
    [(c * pp + r) * n, (c * pp + r + 1) * n) with n = num_layers / (pp * vpp).
    `split` gives the number of layers of each stage explicitly (no VPP)."""
    chunks = vpp or 1
    if split is not None:
        if chunks > 1:
            raise BridgeError("parallel.pp_layer_split cannot be combined with parallel.vpp")
        if len(split) != pp or sum(split) != num_layers or min(split) < 1:
            raise BridgeError(
                f"parallel.pp_layer_split={list(split)} must have pp={pp} positive entries summing to {num_layers}"
            )
        start = sum(split[:pp_rank])
        return list(range(start, start + split[pp_rank]))
    if num_layers % (pp * chunks):
        raise BridgeError(f"parallel.pp*vpp = {pp * chunks} must divide num_hidden_layers={num_layers}")
    n = num_layers // (pp * chunks)
    c = vp_stage or 0
    start = (c * pp + pp_rank) * n
    return list(range(start, start + n))


def rank_experts(num_experts: int, ep: int, ep_rank: int) -> list[int]:
    """Global indices of the experts held by expert-parallel rank `ep_rank`."""
    if num_experts % ep:
        raise BridgeError(f"parallel.ep={ep} must divide the model's num_experts={num_experts}")
    n = num_experts // ep
    return list(range(ep_rank * n, (ep_rank + 1) * n))


def check_layout(arch: ModelArch, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None, cp: int = 1,
                 vpp: Optional[int] = None, pp_split: Optional[Sequence[int]] = None) -> None:
    """Raise BridgeError (naming the parallel field) if the layout does not divide the model."""
    etp = tp if etp is None else etp
    if arch.num_heads % tp:
        raise BridgeError(f"parallel.tp={tp} must divide the model's num_attention_heads={arch.num_heads}")
    if arch.num_kv_heads % tp:
        raise BridgeError(f"parallel.tp={tp} must divide the model's num_key_value_heads={arch.num_kv_heads}")
    if arch.ffn_hidden_size % tp:
        raise BridgeError(f"parallel.tp={tp} must divide the model's intermediate_size={arch.ffn_hidden_size}")
    if arch.is_moe:
        if arch.num_experts % ep:
            raise BridgeError(f"parallel.ep={ep} must divide the model's num_experts={arch.num_experts}")
        if arch.moe_ffn_hidden_size % etp:
            raise BridgeError(
                f"parallel.etp={etp} must divide the model's moe_intermediate_size={arch.moe_ffn_hidden_size}"
            )
    elif ep > 1:
        raise BridgeError(f"parallel.ep={ep} but the model (model_type={arch.model_type!r}) has no experts")
    if pp_split is not None or vpp or pp > 1:
        stage_layers(arch.num_layers, pp, 0, vpp=vpp, split=pp_split)
    if cp > 1 and arch.sliding_window is not None:
        raise BridgeError("parallel.cp > 1 is not supported with sliding-window attention")

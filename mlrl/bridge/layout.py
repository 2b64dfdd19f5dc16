"""Which layers, experts and shapes a parallel layout gives each rank, and whether the layout
divides the model (`check_layout`, also called by config validation before any process starts).

Pure Python, no torch: the launcher validates a config before it imports torch.
"""

from __future__ import annotations

from typing import Optional, Sequence

from mlrl.bridge.arch import BridgeError, ModelArch


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

"""How a full (unsharded) Megatron tensor is split across TP ranks.

Pure torch, no megatron import. The invariants (tested round trip, bit-exact):
- `unshard([shard(t, rule, r, n) for r in range(n)], rule, ...) == t` for every rule;
- TP rules follow Megatron-Core's layers: ColumnParallelLinear splits dim 0, RowParallelLinear
  dim 1, VocabParallelEmbedding / the output layer split the vocabulary (dim 0) after padding it
  to `padded_vocab_size` with zero rows, and a gated MLP's fused fc1 `[gate; up]` is split so
  that rank r holds `[gate_r; up_r]` (Megatron's GLU layout under TP);
- which layers / experts a rank holds, and `check_layout`: mlrl.bridge.layout (torch-free).
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch

from mlrl.bridge.arch import BridgeError

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

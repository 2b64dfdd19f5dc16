"""MoE router replay (R3) on the trainer ranks, through megatron-core's own `RouterReplay`.

With `moe_enable_routing_replay=True` every `TopKRouter` owns a `RouterReplay` whose action
decides its top-k (megatron/core/transformer/moe/router_replay.py): RECORD keeps the indices the
router chose; REPLAY_FORWARD takes given indices and gathers the gates from the router's own
scores at them (`scores.gather(1, idx)`, then the usual softmax / normalisation), so gradients
still reach the router. mlrl drives each router's instance directly (its layer is known from
`router.layer_number`) rather than megatron's class-wide instance list, which also holds the
routers of the KL reference and the critic.

Token layout: a router sees its micro-batch row flattened ([S', 1] THD -> S' tokens; with
sequence parallelism this TP rank's contiguous S'/tp slice), so the rows given to a forward are
the MicroBatch's [S, layers, top_k] rows, padded to S' and sliced like the tokens. Pipeline
stages hold their own layers (global layer = layer_number - 1); expert parallelism routes before
dispatch, on the rank's own tokens, so it needs nothing more.

Without replay the trainer's own choices can be recorded and compared with the engine's
(`agreement`): per token and MoE layer, do the two top-k sets match?
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Literal, Optional

import torch

if TYPE_CHECKING:
    from megatron.core.transformer.moe.router_replay import RouterReplay

Mode = Literal["replay", "record"]


def moe_routers(chunk: torch.nn.Module) -> list[tuple[int, RouterReplay]]:
    """(global layer index, RouterReplay) of every MoE router of a model chunk, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    out: list[tuple[int, RouterReplay]] = []
    for m in chunk.modules():
        rr = getattr(m, "router_replay", None) if isinstance(m, TopKRouter) else None
        if isinstance(m, TopKRouter) and rr is not None:
            if m.layer_number is None:
                raise RuntimeError("router replay: a MoE router without its layer_number")
            out.append((int(m.layer_number) - 1, rr))
    return sorted(out, key=lambda x: x[0])


def local_rows(rows: torch.Tensor, padded_len: int, *, sp_rank: int = 0,
               sp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, L, k] rows of a micro-batch (-1 = never computed by the engine) -> this rank's
    ([S'/sp, L, k] int64 experts, [S'/sp] bool "the engine computed it"); rows the engine never
    computed and the sequence-parallel padding route to experts 0..k-1."""
    S, top_k = rows.shape[0], rows.shape[-1]
    full = rows.to(torch.int64)
    if padded_len > S:
        full = torch.cat([full, full.new_full((padded_len - S, *rows.shape[1:]), -1)])
    real = full[:, 0, 0] >= 0
    full = torch.where(full >= 0, full, torch.arange(top_k, dtype=torch.int64))
    n = padded_len // sp_size
    sl = slice(sp_rank * n, (sp_rank + 1) * n)
    return full[sl], real[sl]


class RouterControl:
    """Sets every router of the chunk that runs a micro-batch to replay or record it."""

    def __init__(self) -> None:
        self.mode: Optional[Mode] = None
        self._pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.matches = 0   # record mode: token-layer top-k sets equal to the engine's
        self.compared = 0  # record mode: token-layer pairs compared

    @contextmanager
    def active(self, mode: Optional[Mode]) -> Iterator["RouterControl"]:
        self.mode, self.matches, self.compared = mode, 0, 0
        try:
            yield self
        finally:
            self.mode = None

    def before_forward(self, chunk: torch.nn.Module, rows: Optional[torch.Tensor], *, padded_len: int,
                       sp_rank: int, sp_size: int) -> None:
        """`rows`: the MicroBatch's [S, L, k]. A micro-batch without rows (padding only, or a
        sequence no engine generated, e.g. the weight sync's canary) is routed by the trainer."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routers = moe_routers(chunk)
        self._pending = None
        if self.mode is None or rows is None or not routers:
            for _, rr in routers:
                rr.clear_router_replay_action()
                rr.clear_indices()
            return
        if rows.shape[1] <= routers[-1][0]:
            raise ValueError(f"router replay: routed experts for {rows.shape[1]} layers, the model's MoE layers "
                             f"reach layer {routers[-1][0]}")
        self._pending = local_rows(rows, padded_len, sp_rank=sp_rank, sp_size=sp_size)
        local = self._pending[0]
        for layer, rr in routers:
            rr.clear_indices()
            if self.mode == "replay":
                rr.set_target_indices(local[:, layer, :].contiguous())
                rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            else:
                rr.set_router_replay_action(RouterReplayAction.RECORD)

    def after_forward(self, chunk: torch.nn.Module) -> None:
        """Record mode: compare what the routers chose with the engine's rows; then every router
        is back to its own routing."""
        routers = moe_routers(chunk)
        if self._pending is None:
            return
        local, mask = self._pending
        for layer, rr in routers:
            chosen = rr.get_recorded_indices() if self.mode == "record" else rr.target_topk_idx
            if self.mode == "record" and chosen is not None:
                same = (chosen.sort(dim=-1).values.cpu() == local[:, layer, :].sort(dim=-1).values).all(dim=-1)
                self.matches += int(same[mask].sum())
                self.compared += int(mask.sum())
            rr.clear_indices()
            rr.clear_router_replay_action()

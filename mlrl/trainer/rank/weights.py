"""HF weights into the sharded Megatron model, and the sharded model out as HF tensors.

`LocalParams` pairs every parameter of this rank's model chunks with its bridge `ParamSpec`
(global layer / expert indices recovered from Megatron's own `layer_number` and this rank's
expert-parallel offset, cross-checked against the bridge's pipeline split). It is the single
place that knows which TP group and which TP rank a tensor is sharded over (experts use the
expert-tensor-parallel group), so loading and exporting cannot disagree.

Loading: each rank reads only the HF tensors its own parameters are made of (its pipeline
stage's layers, its experts), converts, shards and copies; a parameter without an HF mapping or
a shard of the wrong shape is an error naming the tensor.

Export (`iter_hf_buckets`): a collective. Every trainer rank must call it and exhaust the
iterator. Per pipeline stage, the ranks with dp 0 / cp 0 all-gather TP shards, the ranks with
expert-dp 0 all-gather experts over EP (and expert TP); the stage's sender (tp 0, dp 0, cp 0)
converts to HF names and yields lists of (name, tensor) of at most ~bucket_bytes (a tensor
larger than a bucket is alone in its bucket). Other ranks yield nothing. Yielded tensors may
alias parameters: consume them before the next optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, cast

import torch
import torch.distributed as dist

from mlrl.bridge import (
    ArchSpec,
    BridgeError,
    HFCheckpoint,
    ModelArch,
    ParamSpec,
    global_name,
    padded_vocab_size,
    shard,
    stage_layers,
    unshard,
)
from mlrl.trainer.rank.parallel import Ranks

_OUTPUT_LAYER = "output_layer.weight"


@dataclass
class LocalParam:
    local_name: str
    param: torch.nn.Parameter
    spec: ParamSpec


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = cast(torch.nn.Module, chunk.module)
    return chunk


class LocalParams:
    """This rank's parameters, each with its bridge spec and TP placement."""

    def __init__(self, chunks: list[torch.nn.Module], spec: ArchSpec, arch: ModelArch, ranks: Ranks, *,
                 vpp: Optional[int], pp_split: Optional[list[int]], lm_head: bool = True):
        """lm_head=False: the model's `output_layer` is not the HF lm_head (a critic's value head):
        it is neither loaded nor exported, and the HF lm_head is not read."""
        from megatron.core import parallel_state as ps

        self.spec, self.arch, self.ranks = spec, arch, ranks
        self.padded_vocab = padded_vocab_size(arch.vocab_size, ranks.tp_size)
        by_name = {p.name: p for p in spec.params(arch, output_layer_when_tied=ranks.pp_size > 1)
                   if lm_head or p.name != _OUTPUT_LAYER}
        n_local_experts = arch.num_experts // ranks.ep_size if arch.is_moe else 0
        self.items: list[LocalParam] = []
        seen: set[str] = set()
        all_layers: set[int] = set()
        for c, chunk in enumerate(chunks):
            model = _unwrap(chunk)
            # Module.__getattr__ types the GPTModel's decoder as Tensor | Module
            layers = [layer.layer_number - 1 for layer in model.decoder.layers]  # pyright: ignore[reportAttributeAccessIssue, reportGeneralTypeIssues]
            expected = stage_layers(
                arch.num_layers, ranks.pp_size, ranks.pp, vpp=vpp, vp_stage=c if vpp else None, split=pp_split
            )
            if layers != expected:
                raise RuntimeError(
                    f"pipeline split mismatch: Megatron built layers {layers} on pp rank {ranks.pp} chunk {c}, the "
                    f"bridge expects {expected}"
                )
            for name, param in model.named_parameters():
                gname = global_name(name, layers, expert_offset=ranks.ep * n_local_experts)
                if not lm_head and gname == _OUTPUT_LAYER:
                    continue
                if gname not in by_name:
                    raise BridgeError(
                        f"Megatron parameter {name!r} (global {gname!r}) has no HF mapping in the {arch.model_type} "
                        "spec"
                    )
                if gname in seen:
                    raise BridgeError(f"two Megatron parameters map to {gname!r}")
                seen.add(gname)
                self.items.append(LocalParam(name, param, by_name[gname]))
            all_layers.update(layers)
        experts = set(range(ranks.ep * n_local_experts, (ranks.ep + 1) * n_local_experts))
        want = {n for n, p in by_name.items()
                if (p.layer in all_layers and (not p.is_expert or p.expert in experts))
                or (p.stage == "first" and ranks.is_first_stage) or (p.stage == "last" and ranks.is_last_stage)}
        if want - seen:
            raise BridgeError(
                f"{sorted(want - seen)[0]!r} of the {arch.model_type} spec has no parameter in the Megatron model "
                f"on pp rank {ranks.pp} / ep rank {ranks.ep}"
            )
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._etp_group = ps.get_expert_tensor_parallel_group()
        self._ep_group = ps.get_expert_model_parallel_group()

    def tp_placement(self, p: ParamSpec) -> tuple[int, int]:
        """(rank, size) of the tensor-parallel group `p` is sharded over."""
        if p.is_expert:
            return self.ranks.etp, self.ranks.etp_size
        return self.ranks.tp, self.ranks.tp_size

    def shard_of(self, p: ParamSpec, full: torch.Tensor) -> torch.Tensor:
        rank, size = self.tp_placement(p)
        return shard(full, p.tp, rank, size, padded_rows=self.padded_vocab if p.tp == "vocab" else None)

    # ---- load ------------------------------------------------------------------------------------
    def load_hf(self, ckpt: HFCheckpoint) -> None:
        """Copy this rank's part of the HF checkpoint into its parameters (layer by layer)."""
        groups: dict[Optional[int], list[LocalParam]] = {}
        for item in self.items:
            groups.setdefault(item.spec.layer, []).append(item)
        for _, items in groups.items():
            names = sorted({n for it in items for n in it.spec.hf})
            hf = ckpt.read(names)
            for it in items:
                full = self.spec.to_megatron(self.arch, it.spec, hf)
                local = self.shard_of(it.spec, full)
                if tuple(local.shape) != tuple(it.param.shape):
                    raise BridgeError(
                        f"{it.spec.name}: shard of shape {tuple(local.shape)} from {', '.join(it.spec.hf)}, "
                        f"the Megatron parameter {it.local_name!r} has shape {tuple(it.param.shape)}"
                    )
                with torch.no_grad():
                    it.param.data.copy_(local.to(it.param.dtype))

    # ---- export ----------------------------------------------------------------------------------
    def _gather_tp(self, p: ParamSpec, local: torch.Tensor) -> torch.Tensor:
        rank, size = self.tp_placement(p)
        if size == 1 or p.tp == "replicated":
            return unshard([local], p.tp, rows=self.arch.vocab_size) if p.tp == "vocab" else local
        group = self._etp_group if p.is_expert else self._tp_group
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return unshard(parts, p.tp, rows=self.arch.vocab_size)

    def _full_tensors(self, grads: bool = False) -> Iterator[tuple[ParamSpec, torch.Tensor]]:
        """(spec, full megatron tensor) for this stage; empty on ranks that send nothing.
        The order of collectives is the same on every rank of a group (local parameter order)."""
        r = self.ranks
        n_local = self.arch.num_experts // r.ep_size if self.arch.is_moe else 0
        for it in self.items:
            # main_grad: set by megatron's DDP on every parameter
            p, local = it.spec, (it.param.main_grad if grads else it.param).detach()  # pyright: ignore[reportAttributeAccessIssue]
            if p.is_expert:
                if r.edp != 0:
                    continue
                full = self._gather_tp(p, local)
                if r.ep_size > 1:
                    parts = [torch.empty_like(full) for _ in range(r.ep_size)]
                    dist.all_gather(parts, full.contiguous(), group=self._ep_group)
                else:
                    parts = [full]
                if not r.is_stage_sender:
                    continue
                assert p.expert is not None  # p.is_expert
                j = p.expert - r.ep * n_local
                for src, t in enumerate(parts):
                    e = src * n_local + j
                    name = p.name.replace(f".local_experts.{p.expert}.", f".local_experts.{e}.")
                    yield (
                        ParamSpec(
                            name,
                            p.shape,
                            tuple(h.replace(f".experts.{p.expert}.", f".experts.{e}.") for h in p.hf),
                            p.tp,
                            p.convert,
                            p.layer,
                            e,
                            p.stage,
                        ),
                        t,
                    )
            else:
                if r.dp != 0 or r.cp != 0:
                    continue
                full = self._gather_tp(p, local)
                if r.is_stage_sender:
                    yield p, full

    def iter_hf(self, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        for p, full in self._full_tensors(grads):
            if p.name == "output_layer.weight" and self.arch.tie_embeddings:
                continue  # the tied copy on the last stage; HF has only embed_tokens
                # (its gradient is all-reduced with the embedding's by finalize_model_grads)
            yield from self.spec.to_hf(self.arch, p, full).items()

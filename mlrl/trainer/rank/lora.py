"""LoRA on the Megatron-Core policy: low-rank adapters on the column- and row-parallel linears.

peft's LoRA, y = W x + (alpha / r) B A x, on the layers peft calls q_proj, k_proj, v_proj, o_proj,
gate_proj, up_proj and down_proj. Megatron fuses q/k/v into `linear_qkv` (per query group:
[q heads of the group, k, v]) and gate/up into `linear_fc1` ([gate; up] per TP rank), so one fused
linear carries one adapter per peft module, each with its own A and B exactly as in peft: the
adapters are peft's tensors, sharded, and the PEFT export is a gather (no conversion).

Sharding under TP (Megatron's own rules for the layer the adapter sits on):
- column-parallel (linear_qkv, linear_fc1): A [r, in] replicated, B [out/tp, r] split with the
  output. h = A x is made whole on every rank by `copy_to_tensor_model_parallel_region` (identity
  forward, all-reduce of dh backward); with sequence parallelism x is this rank's slice of the
  sequence and h is all-gathered over it instead (reduce-scatter backward), and A's gradient is
  summed over TP by finalize_model_grads (`sequence_parallel` attribute).
- row-parallel (linear_proj, linear_fc2): A [r, in/tp] split with the input, B [out, r]
  replicated; h = A x is all-reduced (reduce-scattered over the sequence with sequence
  parallelism, B then gets the `sequence_parallel` attribute).

The adapters are attached as siblings of the linear (`self_attention.lora_linear_qkv`, ...) and
run from a forward hook on it, so the base parameters keep their names (the bridge, checkpoints
and the HF export of the base are unchanged) and Megatron's sharded_state_dict reaches the
adapters through their own `sharded_state_dict` (TP axis of each tensor). The base is frozen
(requires_grad=False before DDP and the optimizer are built: neither has buffers or state for
it). `adapters_disabled` turns every adapter off: the reference policy for KL is the base model,
no second copy in memory.

Initial A is drawn from a generator seeded by (seed, layer, module) on the full tensor and then
sharded, so every layout (TP1, TP2, PP2) starts from the same adapter; B starts at zero.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Mapping, Optional, cast

import torch
import torch.nn.functional as F

from mlrl.config.schema import LoRAConfig

if TYPE_CHECKING:
    from mlrl.bridge.sharding import TPRule

# peft module -> (Megatron parent attribute, linear attribute); slices of a fused linear in order
_LAYER = {
    "q_proj": ("self_attention", "linear_qkv"), "k_proj": ("self_attention", "linear_qkv"),
    "v_proj": ("self_attention", "linear_qkv"), "o_proj": ("self_attention", "linear_proj"),
    "gate_proj": ("mlp", "linear_fc1"), "up_proj": ("mlp", "linear_fc1"), "down_proj": ("mlp", "linear_fc2"),
}
_SLICES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj"),
           "linear_proj": ("o_proj",), "linear_fc2": ("down_proj",)}
_ROW = {"linear_proj", "linear_fc2"}
HF_PARENT = {"self_attention": "self_attn", "mlp": "mlp"}
PREFIX = "lora_"  # adapter modules are named lora_<linear>; LocalParams (the base) skips them


@dataclass(frozen=True)
class AdapterSpec:
    """Where one adapter lives and how its tensors are sharded (the bridge of the adapters)."""

    layer: int            # global decoder layer index
    module: str           # peft name, e.g. q_proj
    parent: str           # Megatron parent attribute (self_attention / mlp)
    row: bool             # on a row-parallel linear (A split over TP) or column-parallel (B split)

    def hf_name(self, which: str) -> str:
        """peft's tensor name inside adapter_model.safetensors ("A" or "B")."""
        return f"base_model.model.model.layers.{self.layer}.{HF_PARENT[self.parent]}.{self.module}.lora_{which}.weight"

    def base_hf_name(self) -> str:
        return f"model.layers.{self.layer}.{HF_PARENT[self.parent]}.{self.module}.weight"

    def tp_rule(self, which: str) -> TPRule:
        """The bridge TP rule of tensor `which` ("A" / "B"): column B split on dim 0, row A on dim 1."""
        if self.row:
            return "row" if which == "A" else "replicated"
        return "column" if which == "B" else "replicated"


class _Adapter(torch.nn.Module):
    def __init__(self, spec: AdapterSpec, a_local: torch.Tensor, b_local_shape: tuple[int, int]):
        super().__init__()
        self.spec = spec
        self.lora_A = torch.nn.Parameter(a_local)
        self.lora_B = torch.nn.Parameter(torch.zeros(b_local_shape, dtype=a_local.dtype, device=a_local.device))


class LoRABranch(torch.nn.Module):
    """The adapters of one Megatron linear; `delta(x)` has the layout of that linear's output."""

    def __init__(self, linear: str, adapters: dict[str, _Adapter], *, scaling: float, dropout: float,
                 sequence_parallel: bool, qkv_groups: Optional[tuple[int, int, int]], out_sizes: dict[str, int]):
        super().__init__()
        self.linear, self.row = linear, linear in _ROW
        self.adapters = torch.nn.ModuleDict(adapters)
        self.scaling, self.dropout, self.sp = scaling, dropout, sequence_parallel
        self.qkv_groups = qkv_groups  # (local query groups, q heads per group, head dim) for linear_qkv
        self.out_sizes = out_sizes    # local output size of every slice of the fused linear
        self.enabled = True

    def typed_adapters(self) -> Mapping[str, _Adapter]:
        """`adapters` (a ModuleDict of _Adapter: its stubs type the values as Module)."""
        return cast("Mapping[str, _Adapter]", self.adapters)

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.dropout > 0):
            return x
        if self.row or self.sp:  # x differs over TP ranks: Megatron's model-parallel RNG
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            tracker = get_cuda_rng_tracker()
            assert tracker is not None  # the getter initialises it
            with tracker.fork():
                return F.dropout(x, self.dropout, True)
        return F.dropout(x, self.dropout, True)  # x replicated over TP: the same mask on every rank

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings as tpm

        x = self._dropped(x)
        adapters = self.typed_adapters()
        if self.row:
            (ad,) = adapters.values()
            h = F.linear(x, ad.lora_A)
            h = tpm.reduce_scatter_to_sequence_parallel_region(h) if self.sp else \
                tpm.reduce_from_tensor_model_parallel_region(h)
            return F.linear(h, ad.lora_B) * self.scaling
        names = list(adapters)
        a = torch.cat([adapters[n].lora_A for n in names]) if len(names) > 1 else adapters[names[0]].lora_A
        h = F.linear(x, a)  # one GEMM and one collective for every slice
        h = tpm.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True) if self.sp else \
            tpm.copy_to_tensor_model_parallel_region(h)
        r = adapters[names[0]].lora_A.shape[0]
        ys = {n: F.linear(h[..., i * r:(i + 1) * r], adapters[n].lora_B) * self.scaling
              for i, n in enumerate(names)}
        lead = h.shape[:-1]
        parts = [ys[n] if n in ys else h.new_zeros((*lead, self.out_sizes[n])) for n in _SLICES[self.linear]]
        if self.linear == "linear_qkv":
            assert self.qkv_groups is not None  # set for linear_qkv
            g, qpg, hd = self.qkv_groups
            q, k, v = parts
            return torch.cat([q.reshape(*lead, g, qpg * hd), k.reshape(*lead, g, hd), v.reshape(*lead, g, hd)],
                             dim=-1).reshape(*lead, -1)
        return torch.cat(parts, dim=-1)

    def hook(self, module, args, kwargs, output):
        if not self.enabled:
            return output
        x = args[0] if args else next(iter(kwargs.values()))  # input_ (local linears) / x (TE linears)
        out, *rest = output
        return (out + self.delta(x).to(out.dtype), *rest)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None):
        """The adapters for dist_checkpointing, each tensor with its TP axis (see module doc)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sd = self.state_dict(prefix="", keep_vars=True)
        axes = {f"adapters.{n}.lora_{'A' if self.row else 'B'}": 1 if self.row else 0 for n in self.adapters}
        return make_sharded_tensors_for_checkpoint(sd, prefix, axes, sharded_offsets)


def _init_a(cfg: LoRAConfig, seed: int, layer: int, module: str, in_features: int) -> torch.Tensor:
    """The full initial A [r, in] of one adapter (the same on every rank and in every layout)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{layer}/{module}".encode()))
    a = torch.empty(cfg.rank, in_features)
    if cfg.init == "gaussian":
        torch.nn.init.normal_(a, std=1.0 / cfg.rank, generator=g)
    else:  # peft's default: nn.Linear's kaiming-uniform
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
    return a


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = cast(torch.nn.Module, chunk.module)
    return chunk


class LoRA:
    """The adapters of this rank's model chunks (built by `attach`)."""

    def __init__(self, cfg: LoRAConfig, branches: list[LoRABranch], base: list[torch.nn.Parameter]):
        self.cfg, self.branches, self.base = cfg, branches, base

    @classmethod
    def attach(cls, chunks: list[torch.nn.Module], cfg: LoRAConfig, *, config, tp_rank: int, tp_size: int,
               seed: int) -> "LoRA":
        """Add the adapters of `cfg.targets` to every decoder layer of `chunks` and freeze the rest.
        `config` is the TransformerConfig (sequence parallelism, heads, dtype)."""
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        base = [p for c in chunks for p in c.parameters()]
        targets = set(cfg.targets)
        heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
        hd = config.kv_channels
        sizes = {"q_proj": heads * hd, "k_proj": groups * hd, "v_proj": groups * hd, "o_proj": config.hidden_size,
                 "gate_proj": config.ffn_hidden_size, "up_proj": config.ffn_hidden_size,
                 "down_proj": config.hidden_size}
        ins = {"o_proj": heads * hd, "down_proj": config.ffn_hidden_size}
        branches: list[LoRABranch] = []
        for chunk in chunks:
            # Module.__getattr__ types the GPTModel's decoder as Tensor | Module
            for layer in _unwrap(chunk).decoder.layers:  # pyright: ignore[reportAttributeAccessIssue, reportGeneralTypeIssues]
                L = layer.layer_number - 1
                for linear, slices in _SLICES.items():
                    wanted = [m for m in slices if m in targets]
                    if not wanted:
                        continue
                    parent_name = _LAYER[wanted[0]][0]
                    parent = getattr(layer, parent_name)
                    lin = getattr(parent, linear)
                    row = linear in _ROW
                    adapters = {}
                    for m in wanted:
                        spec = AdapterSpec(L, m, parent_name, row)
                        a = _init_a(cfg, seed, L, m, ins.get(m, config.hidden_size))
                        if row:
                            a = a.chunk(tp_size, dim=1)[tp_rank]
                            b_shape = (sizes[m], cfg.rank)
                        else:
                            b_shape = (sizes[m] // tp_size, cfg.rank)
                        ref = next(lin.parameters())
                        ad = _Adapter(spec, a.to(device=ref.device, dtype=config.params_dtype).contiguous(), b_shape)
                        split = ad.lora_A if row else ad.lora_B
                        set_tensor_model_parallel_attributes(split, True, 1 if row else 0, 1)
                        if config.sequence_parallel:  # megatron's attribute (finalize_model_grads)
                            (ad.lora_B if row else ad.lora_A).sequence_parallel = True  # pyright: ignore[reportAttributeAccessIssue]
                        adapters[m] = ad
                    branch = LoRABranch(
                        linear, adapters, scaling=cfg.scaling, dropout=cfg.dropout,
                        sequence_parallel=config.sequence_parallel,
                        qkv_groups=(groups // tp_size, heads // groups, hd) if linear == "linear_qkv" else None,
                        out_sizes={m: sizes[m] // tp_size for m in slices})
                    parent.add_module(PREFIX + linear, branch)
                    lin.register_forward_hook(branch.hook, with_kwargs=True)
                    branches.append(branch)
        for p in base:
            p.requires_grad_(False)
        return cls(cfg, branches, base)

    def adapters(self) -> Iterator[_Adapter]:
        for b in self.branches:
            yield from b.typed_adapters().values()

    def full_adapters(self, ranks) -> Iterator[tuple[AdapterSpec, torch.Tensor, torch.Tensor]]:
        """Collective over TP: (spec, full A, full B) of every adapter of this rank's stage, yielded
        on the stage's sender (tp 0, dp 0, cp 0) only; ranks with dp or cp != 0 take no part."""
        from megatron.core import parallel_state as ps

        from mlrl.bridge import unshard

        if ranks.dp != 0 or ranks.cp != 0:
            return
        group = ps.get_tensor_model_parallel_group()
        for ad in self.adapters():
            full = []
            for which, t in (("A", ad.lora_A), ("B", ad.lora_B)):
                t = t.detach()
                rule = ad.spec.tp_rule(which)
                if ranks.tp_size > 1 and rule != "replicated":
                    parts = [torch.empty_like(t) for _ in range(ranks.tp_size)]
                    torch.distributed.all_gather(parts, t.contiguous(), group=group)
                    t = unshard(parts, rule)
                full.append(t)
            if ranks.is_stage_sender:
                yield ad.spec, full[0], full[1]

    def merge_into(self, hf_tensors: Iterator[tuple[str, torch.Tensor]],
                   full: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The base's HF tensors with W + scaling * B A for every adapted one (a new tensor; the
        frozen base is untouched). `full`: base HF name -> (full A, full B)."""
        for name, t in hf_tensors:
            if name in full:
                a, b = full[name]
                t = (t.float() + self.cfg.scaling * (b.float() @ a.float())).to(t.dtype)
            yield name, t

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model: every adapter off (the reference policy for KL)."""
        for b in self.branches:
            b.enabled = False
        try:
            yield
        finally:
            for b in self.branches:
                b.enabled = True

"""Megatron-Core's local layer spec (no Transformer Engine) adapted for CPU training.

Two substitutions, each for a gap of the stock local spec:
1. core attention -> `PackedDotProductAttention` (packed THD micro-batches, below);
2. with sequence parallelism, the norm -> `SequenceParallelRMSNorm`: the local spec's
   `WrappedTorchNorm` asserts `not config.sequence_parallel`, because its weight lacks the
   `sequence_parallel` attribute that makes `finalize_model_grads` all-reduce the norm's
   gradient over TP (each TP rank sees only its slice of the sequence). Same math
   (torch.nn.RMSNorm), attribute set.

Packed sequences:

Megatron feeds packed sequences through `PackedSeqParams(qkv_format="thd")`: RoPE is then
applied per sample (positions restart at every cu_seqlens boundary, rope_utils'
`_apply_rotary_pos_emb_thd`), and the core attention receives q/k/v as [t, heads, dim] with the
sample boundaries. Only TEDotProductAttention accepts that; the local `DotProductAttention`
asserts `packed_seq_params is None`.

Choice: on CPU we keep Megatron's own attention math and run `DotProductAttention.forward`
once per distinct sample length, the samples of that length stacked as its batch dimension, each
with its causal mask: block-diagonal causal attention at O(sum of len^2) cost, with no
cross-sample attention, no padding, and one kernel call per length instead of one per sample (an
RL step packs hundreds of short samples, most of a few lengths). The alternatives were one row
per sample padded to the longest (wastes compute on padding) or a dense [t, t] block-diagonal
mask (O(t^2) memory per layer). On GPU the TE spec handles THD
natively and this class is not used.

Each length's batch goes through torch's fused `scaled_dot_product_attention` (causal, grouped
query heads served natively) when the layer is plain softmax attention in fp32: no dropout, no
sliding window, no learnable softmax offset, no query-key layer scaling. Megatron's unfused
math (baddbmm, masked softmax, bmm, with the key / value heads repeated) costs more forward +
backward per layer, this module timed on 2 threads with 4 query / 2 key-value heads of 32:
9.0 vs 5.9 ms for 512 samples of 8 tokens, 50 vs 20 ms for 16 samples of 256. The two agree to
float32 rounding (tests/unit/trainer/test_packed_attention.py).
HF transformers' default attention is the same torch kernel. Any other layer keeps Megatron's
`DotProductAttention.forward`.

Shared prefixes (trainer.shared_prefix_packing; layout in mlrl/experience/batch.py): a segment
that continues a shared prompt segment attends to that prompt's keys / values, then causally to
its own. The segments of one (prompt length, own length) shape go to the fused kernel as one
batch, the prompt's key / value rows gathered once per segment, with the explicit mask
[own, prompt + own] (all prompt columns, causal over its own). Gradients of the shared rows sum
over every response that read them (index_select's backward), which is what the same responses
packed one by one, each with a copy of the prompt, give in total. Layers the fused kernel
reproduces only, in any float dtype (bf16 included: Megatron's own math has no such mask).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.torch_norm import WrappedTorchNorm


class PackedDotProductAttention(DotProductAttention):
    """DotProductAttention that accepts THD inputs by attending within each packed sample."""

    def __init__(self, config, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        heads, groups = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
        # the layers whose math torch's fused kernel reproduces (module docstring); the dtype is checked per call
        self.fused = (
            self.attn_mask_type == AttnMaskType.causal and self.attention_dropout.p == 0.0
            and self.config.softmax_type == "vanilla" and self.scale_mask_softmax.window_size is None
            and not self.config.apply_query_key_layer_scaling and heads % groups == 0
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **kwargs,
    ):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=None, **kwargs)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"PackedDotProductAttention: qkv_format {packed_seq_params.qkv_format!r}, expected 'thd'")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        prefix = getattr(packed_seq_params, "mlrl_prefix_segment", None)
        if prefix is not None:
            return self._forward_shared(query, key, value, bounds, prefix, attention_bias)
        by_len: dict[int, list[int]] = {}  # sample length -> start offsets of the samples that long
        runs: list[list[int]] = []  # [length, count]: consecutive samples of one length
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi > lo:
                by_len.setdefault(hi - lo, []).append(lo)
                if runs and runs[-1][0] == hi - lo:
                    runs[-1][1] += 1
                else:
                    runs.append([hi - lo, 1])
        if len(runs) == len(by_len) and bounds[0] == 0 and bounds[-1] == query.shape[0]:
            return self._forward_runs(query, key, value, runs, attn_mask_type, attention_bias)
        return self._forward_by_length(query, key, value, by_len, attn_mask_type, attention_bias)

    def _forward_by_length(self, query, key, value, by_len, attn_mask_type, attention_bias):
        """Any layout: the samples of each length gathered into one batch, the outputs put back in
        packed order."""
        outs, order = [], []
        for length, starts in by_len.items():
            # the samples of one length attend as one batch: [s, b, heads, dim], causal mask per sample
            idx = (torch.tensor(starts).unsqueeze(1) + torch.arange(length)).reshape(-1).to(query.device)
            b = len(starts)
            q, k, v = (_rows(x, idx, b, length) for x in (query, key, value))
            out = self._attend(q, k, v, attn_mask_type, attention_bias)  # [s, b, heads * dim]
            outs.append(out.transpose(0, 1).reshape(b * length, 1, -1))
            order.append(idx)
        if not outs:
            return query.new_zeros(0, 1, query.shape[1] * value.shape[-1])
        return _in_packed_order(outs, order)  # Attention reshapes to (t, 1, -1)

    def _forward_runs(self, query, key, value, runs, attn_mask_type, attention_bias):
        """The usual layout of a packed micro-batch (mlrl packs samples longest first): the samples
        of each length sit next to each other, so each length's batch is a contiguous block of rows,
        a view. No gather of q / k / v and no inverse permutation of the output (nor their
        index_add backwards): on the CPU demo's step those cost about 8 ms of 130 (torch.profiler).
        The batches and kernels are `_forward_by_length`'s, so are the results, bit for bit."""
        sizes = [length * count for length, count in runs]
        if len(runs) == 1:
            blocks = [(query, key, value)]
        else:
            blocks = list(zip(*(x.split(sizes, dim=0) for x in (query, key, value))))
        outs = []
        for (length, b), (q, k, v) in zip(runs, blocks):
            q, k, v = (x.view(b, length, *x.shape[1:]).transpose(0, 1) for x in (q, k, v))
            out = self._attend(q, k, v, attn_mask_type, attention_bias)  # [s, b, heads * dim]
            outs.append(out.transpose(0, 1).reshape(b * length, 1, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def _forward_shared(self, query, key, value, bounds, prefix, attention_bias):
        """Rows with shared prefixes: see the module docstring."""
        if not (self.fused and attention_bias is None):  # (any float dtype: Megatron's math has no such mask)
            raise ValueError(
                "trainer.shared_prefix_packing: this attention layer is not plain causal softmax attention "
                "(dropout, sliding window, softmax offset, query-key layer scaling or attention bias); "
                "shared-prefix packing supports only that kind: set trainer.shared_prefix_packing=never")
        shapes: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (prompt, own) -> [(prompt start, own start)]
        for (lo, hi), h in zip(zip(bounds[:-1], bounds[1:]), prefix):
            if hi > lo:
                p = (bounds[h], bounds[h + 1]) if h >= 0 else (lo, lo)
                shapes.setdefault((p[1] - p[0], hi - lo), []).append((p[0], lo))
        outs, order = [], []
        dev = query.device
        for (plen, length), starts in shapes.items():
            b = len(starts)
            ps = torch.tensor([a for a, _ in starts], device=dev).unsqueeze(1)
            os_ = torch.tensor([c for _, c in starts], device=dev).unsqueeze(1)
            q_idx = (os_ + torch.arange(length, device=dev)).reshape(-1)
            kv_idx = torch.cat([ps + torch.arange(plen, device=dev), os_ + torch.arange(length, device=dev)],
                               dim=1).reshape(-1)
            q = query.index_select(0, q_idx).view(b, length, *query.shape[1:]).transpose(1, 2)
            k, v = (x.index_select(0, kv_idx).view(b, plen + length, *x.shape[1:]).transpose(1, 2)
                    for x in (key, value))
            mask = None
            if plen:
                own = torch.ones(length, length, dtype=torch.bool, device=dev).tril()
                mask = torch.cat([own.new_ones(length, plen), own], dim=1)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale,
                enable_gqa=q.shape[1] != k.shape[1])  # [b, heads, length, dim]
            outs.append(out.transpose(1, 2).reshape(b * length, 1, -1))
            order.append(q_idx)
        return _in_packed_order(outs, order)

    def _attend(self, q, k, v, attn_mask_type, attention_bias):
        """Causal attention of b samples of one length: q [s, b, heads, dim], k / v [s, b, groups,
        dim] -> [s, b, heads * dim]. Torch's fused kernel where it computes this layer's math, else
        Megatron's. Inputs are made contiguous as [b, heads, s, dim] first, so both packed layouts
        (views of contiguous runs, gathered rows) give the kernel the same memory, hence the same bits."""
        if not (self.fused and q.dtype == torch.float32 and attention_bias is None):
            # contiguous k / v: Megatron `view`s them, which a strided run fails on unless grouped
            # query heads were repeated (a copy) first, i.e. for plain multi-head attention
            return super().forward(q, k.contiguous(), v.contiguous(), None, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=None)
        q, k, v = (x.permute(1, 2, 0, 3).contiguous() for x in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)  # [s, b, heads * dim]


def _in_packed_order(outs: list[torch.Tensor], order: list[torch.Tensor]) -> torch.Tensor:
    """Outputs computed batch by batch ([n_k, 1, heads * dim] for the packed rows order[k]) -> [t, 1,
    heads * dim] in packed order."""
    flat, pos = torch.cat(outs, dim=0), torch.cat(order)
    inverse = torch.empty_like(pos)
    inverse[pos] = torch.arange(pos.numel(), device=pos.device)
    return flat.index_select(0, inverse)


def _rows(x: torch.Tensor, idx: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """The packed rows `idx` of x [t, heads, dim] (b samples of `length` tokens) as [length, b, heads, dim]."""
    return x.index_select(0, idx).view(b, length, *x.shape[1:]).transpose(0, 1)


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm whose weight is marked for the TP all-reduce of sequence parallelism."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs: Any):
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm: normalization={config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # pyright: ignore[reportAttributeAccessIssue]


def _replace(obj: Any, old: type, new: type) -> Any:
    """Copy of a spec tree with every reference to class `old` replaced by `new`."""
    if obj is old:
        return new
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _replace(getattr(obj, f.name), old, new) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes) if any(changes[k] is not getattr(obj, k) for k in changes) else obj
    if isinstance(obj, list):
        items = [_replace(x, old, new) for x in obj]
        return items if any(a is not b for a, b in zip(items, obj)) else obj
    return obj


def local_block_spec(config, vp_stage: Optional[int], pp_rank: int):
    """The decoder block spec of this pipeline chunk, local modules, adapted as described above."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                       vp_stage=vp_stage, pp_rank=pp_rank)
    assert block.layer_specs is not None  # always set by get_gpt_decoder_block_spec
    layer_specs = []
    for spec in block.layer_specs:
        spec = copy.deepcopy(spec)
        # the spec tree's submodules are typed `object` in megatron-core
        spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention  # pyright: ignore[reportAttributeAccessIssue]
        if config.sequence_parallel:
            spec = _replace(spec, WrappedTorchNorm, SequenceParallelRMSNorm)
        layer_specs.append(spec)
    block.layer_specs = layer_specs
    if config.sequence_parallel and block.layer_norm is WrappedTorchNorm:
        block.layer_norm = SequenceParallelRMSNorm  # pyright: ignore[reportAttributeAccessIssue]  # a class builds too
    return block

"""Packed-sequence (THD) attention for Megatron-Core's local layer spec, used on CPU.

Megatron feeds packed sequences through `PackedSeqParams(qkv_format="thd")`: RoPE is then
applied per sample (positions restart at every cu_seqlens boundary, rope_utils'
`_apply_rotary_pos_emb_thd`), and the core attention receives q/k/v as [t, heads, dim] with the
sample boundaries. Only TEDotProductAttention accepts that; the local `DotProductAttention`
asserts `packed_seq_params is None`.

Choice: on CPU we keep Megatron's own attention math and run
`DotProductAttention.forward` once per sample with its causal mask, i.e. block-diagonal causal
attention at O(sum of len^2) cost, with no cross-sample attention and no padding inside a row.
The alternatives were one row per sample padded to the longest (wastes compute on padding) or
a dense [t, t] block-diagonal mask (O(t^2) memory per layer). On GPU the TE spec handles THD
natively and this class is not used.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedDotProductAttention(DotProductAttention):
    """DotProductAttention that accepts THD inputs by attending within each packed sample."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                attn_mask_type=None, attention_bias=None, packed_seq_params=None, **kwargs):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=None, **kwargs)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"PackedDotProductAttention: qkv_format {packed_seq_params.qkv_format!r}, expected 'thd'")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        outs = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi == lo:
                continue
            # [s, heads, dim] -> [s, b=1, heads, dim]; causal mask inside the sample
            out = super().forward(query[lo:hi].unsqueeze(1), key[lo:hi].unsqueeze(1), value[lo:hi].unsqueeze(1), None,
                                  attn_mask_type=attn_mask_type, attention_bias=attention_bias, packed_seq_params=None)
            outs.append(out)
        return torch.cat(outs, dim=0)  # [t, 1, heads * dim]; Attention reshapes to (t, 1, -1)

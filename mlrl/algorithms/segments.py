"""Per-sequence reductions over a packed row.

A MicroBatch concatenates several samples; sequence-level quantities (GSPO's ratio, sequence-level
masked importance sampling) need each token's position inside that concatenation mapped to its
sample. `segment_index` gives that map from `cu_seqlens`, with every padding position sent to an
extra, discarded bucket, so padding can never leak into a sequence's sum.
"""

from __future__ import annotations

import torch


def segment_index(cu_seqlens: torch.Tensor, total_len: int) -> torch.Tensor:
    """[S] int64: k for the tokens of the k-th packed sample, n (= number of samples) for padding."""
    cu = cu_seqlens.to(torch.int64)
    n = int(cu.numel()) - 1
    if n < 0 or int(cu[0]) != 0 or int(cu[-1]) > total_len or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens={cu.tolist()}: expected non-decreasing offsets from 0 to at most {total_len}")
    lengths = cu[1:] - cu[:-1]
    seg = torch.repeat_interleave(torch.arange(n, device=cu.device), lengths)
    pad = torch.full((total_len - int(cu[-1]),), n, dtype=torch.int64, device=cu.device)
    return torch.cat([seg, pad])


def segment_sum(values: torch.Tensor, seg: torch.Tensor, num_segments: int) -> torch.Tensor:
    """[num_segments]: sum of `values` [S] per segment (the padding bucket is dropped)."""
    out = torch.zeros(num_segments + 1, dtype=values.dtype, device=values.device)
    return out.index_add(0, seg, values)[:num_segments]

"""A packed `MicroBatch` as the inputs of Megatron's GPTModel, and the label layout.

The row [S] holds samples back to back, then padding. Megatron receives tokens [1, S'] and
`PackedSeqParams(qkv_format="thd")` whose cu_seqlens cover the samples and, as one extra
segment, the padding (THD kernels and the per-sample RoPE need the segments to tile the row).
S' >= S only when the layout needs it: sequence parallelism needs S' divisible by tp, and
context parallelism needs every segment padded to a multiple of 2*cp (GPU only; the padded
row and `cu_seqlens_*_padded` are built here, and each CP rank keeps its slice).

Labels: position p predicts tokens[p+1] when p+1 is in the same sample (`label_mask`); the
trainer's logprob of token t is then the prediction made at t-1, and the first token of each
sample gets 0 (the MicroBatch convention).

Shared prefixes (MicroBatch.prefix_segment, trainer.shared_prefix_packing): labels stay within
segments as above; what changes is what a segment attends to and where its positions start.
Both travel with the PackedSeqParams to mlrl's CPU attention and RoPE (local_spec.py,
packed_rope.py): `psp.mlrl_prefix_segment` (per segment, its shared segment or -1) and the
attribute `mlrl_positions` on `cu_seqlens_q` (every token's position within its sample: RoPE
receives only cu_seqlens). max_seqlen is the longest whole sample, prefix included (the RoPE
table's length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mlrl.experience.batch import MicroBatch


@dataclass
class ModelInputs:
    tokens: torch.Tensor          # [1, S'] int64 (this CP rank's part of the row on GPU with cp > 1)
    position_ids: torch.Tensor    # [1, S'] int64
    packed_seq_params: Any        # megatron PackedSeqParams
    labels: torch.Tensor          # [S'] int64: next token of the same sample (0 where none)
    label_mask: torch.Tensor      # [S'] bool: labels[p] is a real next token
    length: int                   # S: the MicroBatch's own length (outputs are cut back to it)
    cp_index: Optional[torch.Tensor] = None  # [S'/cp] positions of the full padded row held by this CP rank


def segments(mb: MicroBatch) -> list[int]:
    """Segment boundaries covering the whole row: the samples, then the padding tail if any."""
    cu = [int(x) for x in mb.cu_seqlens.tolist()]
    if not cu or cu[0] != 0:
        raise ValueError(f"MicroBatch.cu_seqlens must start at 0, got {cu[:3]}")
    if any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > mb.num_tokens:
        raise ValueError(f"MicroBatch.cu_seqlens must be non-decreasing and end <= {mb.num_tokens} tokens, got {cu}")
    if cu[-1] < mb.num_tokens:
        cu.append(mb.num_tokens)
    return cu


def sample_lengths(mb: MicroBatch) -> list[int]:
    """Length of the whole sample each segment ends (its shared prefix included)."""
    cu = mb.cu_seqlens.tolist()
    own = [b - a for a, b in zip(cu, cu[1:])]
    if mb.prefix_segment is None:
        return own
    return [n + (own[h] if h >= 0 else 0) for n, h in zip(own, mb.prefix_segment.tolist())]


def check_window(mb: MicroBatch, sliding_window: Optional[int]) -> None:
    if sliding_window is None:
        return
    longest = max(sample_lengths(mb), default=0)
    if longest > sliding_window:
        raise ValueError(
            f"sample of {longest} tokens exceeds the model's sliding_window={sliding_window} (not supported)"
        )


def next_token_labels(tokens: torch.Tensor, cu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels, label_mask) of a row whose samples end at `cu[1:]` (tokens past cu[-1] are
    padding): position p is labelled with tokens[p+1] when p+1 is in p's sample. One pass over
    the row (no loop over the samples: a step packs hundreds of them)."""
    S = tokens.numel()
    dev = tokens.device  # on GPU the whole computation is queued on the device (no host work per token)
    labels = torch.zeros(S, dtype=torch.int64, device=dev)
    label_mask = torch.zeros(S, dtype=torch.bool, device=dev)
    if len(cu) < 2 or cu[-1] <= 0:
        return labels, label_mask
    end = cu[-1]
    ends = torch.tensor(cu[1:], dtype=torch.int64, device=dev)
    pos = torch.arange(end, device=dev)
    # end of the sample holding each position (empty samples own no position)
    sample_end = ends[torch.searchsorted(ends, pos, right=True)]
    label_mask[:end] = pos + 1 < sample_end
    labels[:end - 1] = tokens[1:end]
    labels[:end].masked_fill_(~label_mask[:end], 0)
    return labels, label_mask


# Transformer Engine FP8 GEMMs need the token dimension divisible by 16 (TE's
# assert_dim_for_fp8_exec: leading dims % 8, and its docs: sequence padded to a multiple of 16);
# the block-scaled recipes quantise 128-row tiles (TE pads them internally where it can: 128 is
# the conservative choice that never asks it to).
FP8_TOKEN_MULTIPLE = {"none": 1, "tensorwise": 16, "delayed": 16, "blockwise": 128, "mxfp8": 128}


def row_multiple(*, fp8_recipe: str = "none", tp: int = 1, sequence_parallel: bool = False) -> int:
    """What each rank's row length must be a multiple of: FP8's token multiple, times tp when
    sequence parallelism splits the row over the TP ranks (each slice must satisfy it)."""
    return FP8_TOKEN_MULTIPLE[fp8_recipe] * (tp if sequence_parallel else 1)


def build_inputs(mb: MicroBatch, device: torch.device, *, tp: int = 1, sequence_parallel: bool = False,
                 cp: int = 1, cp_rank: int = 0, fp8_recipe: str = "none") -> ModelInputs:
    from megatron.core.packed_seq_params import PackedSeqParams

    S = mb.num_tokens
    bounds = segments(mb)
    n_samples = mb.num_samples
    if cp > 1:
        if mb.prefix_segment is not None:
            raise ValueError("shared-prefix micro-batches (trainer.shared_prefix_packing) cannot be split for "
                             "context parallelism")
        tokens, pos = mb.tokens.to(torch.int64), mb.position_ids.to(torch.int64)
        labels, label_mask = next_token_labels(tokens, bounds[:n_samples + 1])
        # each CP rank's slice is split over the TP ranks too under sequence parallelism: the slice
        # must divide by tp (Megatron's scatter to the sequence-parallel region asserts it)
        return _cp_inputs(tokens, pos, labels, label_mask, bounds, S, device, cp, cp_rank,
                          row_multiple(fp8_recipe=fp8_recipe, tp=tp, sequence_parallel=sequence_parallel))
    # the row goes to the device first: labels, mask and padding are then built there
    tokens = mb.tokens.to(device=device, dtype=torch.int64)
    pos = mb.position_ids.to(device=device, dtype=torch.int64)
    labels, label_mask = next_token_labels(tokens, bounds[:n_samples + 1])

    pad = (-S) % row_multiple(fp8_recipe=fp8_recipe, tp=tp, sequence_parallel=sequence_parallel)
    if pad:
        if len(bounds) - 1 == n_samples:
            bounds.append(S + pad)
        else:
            bounds[-1] = S + pad
        tokens = torch.cat([tokens, tokens.new_zeros(pad)])
        pos = torch.cat([pos, pos.new_zeros(pad)])
        labels = torch.cat([labels, labels.new_zeros(pad)])
        label_mask = torch.cat([label_mask, label_mask.new_zeros(pad)])
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    max_len = max(b - a for a, b in zip(bounds, bounds[1:]))
    if mb.prefix_segment is not None:
        max_len = max(max_len, *sample_lengths(mb))
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
    )
    if mb.prefix_segment is not None:
        prefix = mb.prefix_segment.tolist()
        # (+ the padding segment)
        psp.mlrl_prefix_segment = prefix + [-1] * (len(bounds) - 1 - len(prefix))  # pyright: ignore[reportAttributeAccessIssue]
        cu.mlrl_positions = pos  # pyright: ignore[reportAttributeAccessIssue]
    return ModelInputs(tokens.unsqueeze(0), pos.unsqueeze(0), psp, labels, label_mask, S)


def cp_padded_lengths(lens: list[int], cp: int, multiple: int = 1) -> list[int]:
    """Each segment padded to a multiple of 2*cp (TE's THD context-parallel split: every segment
    is cut into 2*cp chunks), the last one further so that each CP rank's slice (total / cp) is
    a multiple of `multiple` (`row_multiple`: FP8's token multiple, times tp under sequence
    parallelism)."""
    unit = 2 * cp
    padded = [(n + unit - 1) // unit * unit for n in lens]
    extra = (-sum(padded)) % math.lcm(unit, cp * multiple)  # keeps the last segment a multiple of 2*cp
    if padded and extra:
        padded[-1] += extra
    return padded


def _cp_inputs(tokens, pos, labels, label_mask, bounds, S, device, cp, cp_rank, multiple) -> ModelInputs:
    """GPU only: pad every segment to a multiple of 2*cp and keep this CP rank's THD slice."""
    import transformer_engine_torch as tex  # pyright: ignore[reportMissingImports]  # GPU-only, not in the CPU env
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = [b - a for a, b in zip(bounds, bounds[1:])]
    padded = cp_padded_lengths(lens, cp, multiple)
    index = torch.cat([torch.arange(a, a + n) for a, n in zip(bounds, lens)])
    dest = torch.cat([torch.arange(o, o + n) for o, n in zip(_cumsum(padded), lens)])
    total = sum(padded)

    def spread(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(total)
        out[dest] = x[index]
        return out

    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_padded = torch.tensor(_cumsum(padded) + [total], dtype=torch.int32, device=device)
    keep = tex.thd_get_partitioned_indices(cu_padded, total, cp, cp_rank).long().cpu()
    max_len = max(padded)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                          cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max_len, max_seqlen_kv=max_len)
    full_pos = torch.full((total,), -1, dtype=torch.int64)
    full_pos[dest] = index  # original row position of each padded slot (-1 = CP padding)
    return ModelInputs(spread(tokens)[keep].unsqueeze(0).to(device), spread(pos)[keep].unsqueeze(0).to(device), psp,
                       spread(labels)[keep].to(device), spread(label_mask)[keep].to(device), S,
                       cp_index=full_pos[keep].to(device))


def _cumsum(xs: list[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        out.append(acc)
        acc += x
    return out

"""Packing one RL step's samples into micro-batches for the DP ranks of the trainer.

Order of operations, and the invariant each keeps:
1. loss weights are computed over ALL samples of the step (mlrl.experience.loss_weights.loss_agg_weights)
   before any split, so sum over every micro-batch of every rank of sum_t loss_weight * l_t is the
   step loss whatever the split (the MicroBatch contract in batch.py);
2. samples go to DP ranks by longest-processing-time (longest first, to the rank with the fewest
   tokens so far; ties to the lowest rank), which balances tokens;
3. each rank's samples are packed into micro-batches of at most `token_budget` tokens by
   first-fit decreasing; a sample is never split;
4. every rank gets the same number of micro-batches (Megatron's schedules run the same number of
   forward/backward passes on every DP rank): short ranks receive padding-only micro-batches,
   whose loss weights are all 0;
5. each micro-batch is right-padded to a multiple of `pad_multiple` (pad_multiple = token_budget
   makes every micro-batch exactly token_budget long, e.g. for pipeline parallelism with fixed
   shapes).

With `shared_prefix=True` (trainer.shared_prefix_packing) the unit packed in steps 2-4 is a prompt
group rather than a sample: the group's samples share one copy of their common prefix (see
`shared_prefix_length` and the MicroBatch contract in batch.py), a group too long for one
micro-batch is cut into several units, each with its own copy of the prefix, and every sample
of the group keeps its own segment. Loss weights do not change: the prefix holds no policy token.

Inside a micro-batch samples appear in increasing sample index (with shared prefixes: units in
increasing index of their first sample, a group's samples together). `sample_ids` index into the
`samples` list given to pack_step; per-sample tensors (old / reference logprobs, old critic
values, returns) come back with `attach_per_sample`, per-token trainer outputs go back to
samples with `unpack_per_sample`.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Iterable, Literal, Optional, Sequence

import torch

from mlrl.experience.batch import MicroBatch
from mlrl.experience.loss_weights import loss_agg_weights
from mlrl.types import TOKEN_ADVANTAGES_KEY, Sample


def _balance_ranks(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """LPT: longest sample first, to the rank with the fewest tokens (ties: lowest rank)."""
    heap = [(0, r) for r in range(dp_size)]
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, r = heapq.heappop(heap)
        ranks[r].append(i)
        heapq.heappush(heap, (tokens + lengths[i], r))
    return ranks


def _first_fit_decreasing(indices: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of sample indices, each with total length <= budget, in order of opening."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def token_advantages(s: Sample, index: int = 0) -> list[float]:
    """The per-token advantages of a sample ([T]): the token estimators' list, else Sample.advantage broadcast."""
    tok = s.metadata.get(TOKEN_ADVANTAGES_KEY)
    if tok is None:
        return [float(s.advantage)] * len(s.tokens)
    if len(tok) != len(s.tokens):
        raise ValueError(
            f"samples[{index}].metadata[{TOKEN_ADVANTAGES_KEY!r}] has {len(tok)} values, expected "
            f"len(tokens)={len(s.tokens)}"
        )
    return [float(a) for a in tok]


SHARED = -2  # sample_ids of a shared-prefix segment's tokens


@dataclass(frozen=True)
class _Unit:
    """What packing places whole: samples `ids` sharing their first `shared` tokens (0: one sample)."""

    ids: tuple[int, ...]
    shared: int
    length: int  # packed tokens: shared + sum of the samples' own tokens


def shared_prefix_length(samples: Sequence[Sample]) -> int:
    """Tokens a group of samples can share: their longest common prefix, stopped one token before
    the earliest policy token of any of them (that token's logprob is predicted by the token
    before it, which must be in each sample's own segment), and leaving every sample at least one
    token of its own. 0 when fewer than two samples or nothing can be shared."""
    if len(samples) < 2:
        return 0
    first = samples[0].tokens
    limit = min(len(s.tokens) for s in samples) - 1
    for s in samples:
        f = next((t for t, m in enumerate(s.loss_mask) if m), len(s.tokens))
        limit = min(limit, f - 1)
    n = 0
    while n < limit and all(s.tokens[n] == first[n] for s in samples[1:]):
        n += 1
    return n


def _whole_groups(samples: Sequence[Sample], budget: int) -> list[_Unit]:
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        if not s.group_id:
            raise ValueError(f"pack_step(whole_groups=True): samples[{i}] has no group_id")
        groups.setdefault(s.group_id, []).append(i)
    units = [_Unit(tuple(ids), 0, sum(len(samples[i].tokens) for i in ids)) for ids in groups.values()]
    for u in units:
        if u.length > budget:
            raise ValueError(
                f"pack_step: the group of samples {list(u.ids)} has {u.length} tokens together, more than "
                f"token_budget={budget} (trainer.micro_batch_tokens), and must be packed whole: raise the budget "
                "or lower the sequence limit")
    return sorted(units, key=lambda u: u.ids[0])


def _units(samples: Sequence[Sample], shared_prefix: bool, budget: int) -> list[_Unit]:
    lengths = [len(s.tokens) for s in samples]
    if not shared_prefix:
        return [_Unit((i,), 0, n) for i, n in enumerate(lengths)]
    groups: dict[str, list[int]] = {}
    units: list[_Unit] = []
    for i, s in enumerate(samples):
        if s.group_id:
            groups.setdefault(s.group_id, []).append(i)
        else:
            units.append(_Unit((i,), 0, lengths[i]))
    for ids in groups.values():
        p = shared_prefix_length([samples[i] for i in ids])
        if p == 0:
            units += [_Unit((i,), 0, lengths[i]) for i in ids]
            continue
        chunk: list[int] = []
        size = p
        for i in ids:  # a group longer than the budget: consecutive chunks, each with its own copy of the prefix
            if chunk and size + lengths[i] - p > budget:
                units.append(_chunk(chunk, p, size, lengths))
                chunk, size = [], p
            chunk.append(i)
            size += lengths[i] - p
        units.append(_chunk(chunk, p, size, lengths))
    return sorted(units, key=lambda u: u.ids[0])


def _chunk(ids: list[int], p: int, size: int, lengths: Sequence[int]) -> _Unit:
    return _Unit(tuple(ids), p, size) if len(ids) > 1 else _Unit((ids[0],), 0, lengths[ids[0]])


def _build(
    samples: Sequence[Sample], units: Sequence[_Unit], weights: Sequence[float], pad_multiple: int, pad_token_id: int
) -> MicroBatch:
    tokens: list[int] = []
    pos: list[int] = []
    sid: list[int] = []
    mask: list[float] = []
    weight: list[float] = []
    adv: list[float] = []
    rollout: list[float] = []
    cu = [0]
    prefix: list[int] = []
    for u in units:
        head = -1
        if u.shared:
            s0 = samples[u.ids[0]]
            head = len(cu) - 1
            tokens += s0.tokens[:u.shared]
            pos += range(u.shared)
            sid += [SHARED] * u.shared
            mask += [0.0] * u.shared
            weight += [0.0] * u.shared
            adv += [0.0] * u.shared
            rollout += [0.0] * u.shared
            cu.append(cu[-1] + u.shared)
            prefix.append(-1)
        for i in u.ids:
            s = samples[i]
            a, n = u.shared, len(s.tokens)
            m = [1.0 if x else 0.0 for x in s.loss_mask[a:]]
            tokens += s.tokens[a:]
            pos += range(a, n)
            sid += [i] * (n - a)
            mask += m
            weight += [weights[i] * x for x in m]
            adv += [v * x for v, x in zip(token_advantages(s, i)[a:], m)]
            rollout += [float(x) for x in s.rollout_logprobs[a:]]
            cu.append(cu[-1] + n - a)
            prefix.append(head)
    length = max(pad_multiple, math.ceil(cu[-1] / pad_multiple) * pad_multiple)
    pad = length - cu[-1]
    f32 = torch.float32
    shared = any(u.shared for u in units)
    routed = _routed_rows([samples[i] for u in units for i in u.ids], length)
    if shared and routed is not None:
        raise ValueError("router replay rows cannot be packed with shared prefixes (trainer.shared_prefix_packing)")
    return MicroBatch(
        prefix_segment=torch.tensor(prefix, dtype=torch.int64) if shared else None,
        routed_experts=routed,
        tokens=torch.tensor(tokens + [pad_token_id] * pad, dtype=torch.int64),
        position_ids=torch.tensor(pos + [0] * pad, dtype=torch.int64),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        sample_ids=torch.tensor(sid + [-1] * pad, dtype=torch.int64),
        loss_mask=torch.tensor(mask + [0.0] * pad, dtype=f32),
        loss_weight=torch.tensor(weight + [0.0] * pad, dtype=f32),
        advantages=torch.tensor(adv + [0.0] * pad, dtype=f32),
        rollout_logprobs=torch.tensor(rollout + [0.0] * pad, dtype=f32),
    )


def _routed_rows(samples: Sequence[Sample], length: int) -> Optional[torch.Tensor]:
    """MoE router replay: the samples' routed-expert rows back to back ([length, layers, top_k]
    int16). Positions the engine never computed (each sample's last token, padding) hold -1: the
    trainer routes them to experts 0..top_k-1, harmlessly, since their outputs feed no loss (the
    last position predicts nothing, padding is masked).
    None when no sample carries rows; all or none must (a step is replayed or it is not)."""
    have = [s.routed_experts is not None for s in samples]
    if not any(have):
        return None
    if not all(have):
        raise ValueError("router replay: some samples of the micro-batch carry routed experts and some do not")
    shape = samples[0].routed_experts.shape[1:]
    out = torch.full((length, *shape), -1, dtype=torch.int16)
    off = 0
    for s in samples:
        r = s.routed_experts
        if r.shape[1:] != shape:
            raise ValueError(f"router replay: routed experts of shape {tuple(r.shape)}, expected [*, {shape}]")
        m = min(len(r), len(s.tokens))
        out[off:off + m] = torch.from_numpy(r[:m].astype("int16"))
        off += len(s.tokens)
    return out


def pack_step(
    samples: Sequence[Sample],
    *,
    dp_size: int,
    token_budget: int,
    loss_agg: str,
    pad_multiple: int = 1,
    norm_len: Optional[int] = None,
    pad_token_id: int = 0,
    shared_prefix: bool = False,
    whole_groups: bool = False,
) -> tuple[list[list[MicroBatch]], dict[str, float]]:
    """Pack one step: returns (micro_batches[rank][k], metrics); every rank has the same count.

    loss_agg / norm_len: the aggregation (algorithm.loss_agg) and Dr.GRPO's constant length for
    seq-mean-token-sum-norm (see loss_agg_weights). token_budget (trainer.micro_batch_tokens) is
    the maximum micro-batch length including padding, so it must be a multiple of pad_multiple.
    Metrics: pack/padding_frac (padding tokens / all tokens, padding-only micro-batches
    included), pack/micro_batches_per_rank, pack/tokens_per_rank_{min,max,mean} (real tokens),
    pack/rank_imbalance (max / mean), pack/num_samples, pack/num_tokens, pack/num_loss_tokens.
    shared_prefix: pack each prompt group around one copy of its common prefix (module docstring);
    pack/num_tokens then counts the packed tokens, pack/shared_prefix_saved_frac the share of the
    samples' tokens that sharing left out.
    whole_groups: the samples of one group_id go to one micro-batch together, in sample order (DPO's
    chosen / rejected pairs); no prefix is shared, and a group longer than token_budget is an error.
    """
    if dp_size < 1:
        raise ValueError(f"pack_step: dp_size={dp_size}, expected >= 1")
    if pad_multiple < 1:
        raise ValueError(f"pack_step: pad_multiple={pad_multiple}, expected >= 1")
    if token_budget < 1 or token_budget % pad_multiple:
        raise ValueError(
            f"pack_step: token_budget={token_budget} (trainer.micro_batch_tokens), expected a positive multiple of "
            f"pad_multiple={pad_multiple}"
        )
    if not samples:
        raise ValueError("pack_step: no samples to pack")
    lengths = [len(s.tokens) for s in samples]
    for i, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"pack_step: samples[{i}] has no tokens")
        if n > token_budget:
            raise ValueError(
                f"pack_step: samples[{i}] has {n} tokens, more than token_budget={token_budget} "
                "(trainer.micro_batch_tokens): raise the budget or lower the prompt / response limits"
            )
    weights = loss_agg_weights([s.num_loss_tokens for s in samples], loss_agg, norm_len)
    if whole_groups and shared_prefix:
        raise ValueError("pack_step: whole_groups and shared_prefix cannot be combined")
    units = _whole_groups(samples, token_budget) if whole_groups else _units(samples, shared_prefix, token_budget)
    sizes = [u.length for u in units]
    bins = [_first_fit_decreasing(r, sizes, token_budget) for r in _balance_ranks(sizes, dp_size)]
    per_rank = max(1, max(len(b) for b in bins))
    out = [
        [_build(samples, [units[k] for k in ks], weights, pad_multiple, pad_token_id) for ks in rank_bins]
        + [_build(samples, [], weights, pad_multiple, pad_token_id) for _ in range(per_rank - len(rank_bins))]
        for rank_bins in bins
    ]
    real = [sum(sizes[k] for b in rank_bins for k in b) for rank_bins in bins]
    total = sum(mb.num_tokens for rank in out for mb in rank)
    mean = sum(real) / dp_size
    metrics = {
        "pack/padding_frac": (total - sum(real)) / total,
        "pack/micro_batches_per_rank": float(per_rank),
        "pack/tokens_per_rank_min": float(min(real)),
        "pack/tokens_per_rank_max": float(max(real)),
        "pack/tokens_per_rank_mean": mean,
        "pack/rank_imbalance": max(real) / mean,
        "pack/num_samples": float(len(samples)),
        "pack/num_tokens": float(sum(real)),
        "pack/num_loss_tokens": float(sum(s.num_loss_tokens for s in samples)),
    }
    if shared_prefix:
        metrics["pack/shared_prefix_saved_frac"] = 1.0 - sum(real) / sum(lengths)
    return out, metrics


# --------------------------------------------------------------------------- per-sample <-> per-token


def _segments(mb: MicroBatch) -> Iterable[tuple[int, int, int, int, int]]:
    """(sample index, start, end, prefix start, prefix end) of each packed segment, in row order;
    a sample's tokens are row[prefix start:prefix end] + row[start:end] (an empty prefix span
    without shared-prefix packing). A shared-prefix segment has sample index SHARED."""
    cu = mb.cu_seqlens.tolist()
    ids = mb.sample_ids[mb.cu_seqlens[:-1].long()].tolist() if len(cu) > 1 else []  # one gather, not one per sample
    if mb.prefix_segment is None:
        return ((i, a, b, 0, 0) for i, a, b in zip(ids, cu[:-1], cu[1:]))
    return [(i, a, b, cu[h], cu[h + 1]) if h >= 0 else (i, a, b, 0, 0)
            for i, a, b, h in zip(ids, cu[:-1], cu[1:], mb.prefix_segment.tolist())]


def gather_per_sample(mb: MicroBatch, per_sample: Sequence[torch.Tensor]) -> torch.Tensor:
    """[S] tensor for one micro-batch from per-sample [T_i] tensors (indexed by sample id), 0 on
    padding; a shared prefix takes its values from the first sample sharing it. Differentiable
    (the inverse of unpack_per_sample for one micro-batch)."""
    parts = []
    ref = None
    segs = list(_segments(mb))
    owner = {}  # shared segment start -> the first sample continuing it
    for i, _a, _b, pa, pb in segs:
        if pb > pa:
            owner.setdefault(pa, i)
    for i, a, b, pa, pb in segs:
        shared = i == SHARED
        j = owner.get(a) if shared else i
        if j is None:
            raise ValueError(f"micro-batch: shared-prefix segment at {a} is continued by no sample")
        if j >= len(per_sample):
            raise ValueError(f"micro-batch holds sample {j} but only {len(per_sample)} per-sample tensors were given")
        t = per_sample[j].reshape(-1)
        want = (b - a) if shared else (pb - pa) + (b - a)
        if t.numel() < want or (not shared and t.numel() != want):
            raise ValueError(f"per-sample tensor {j} has {t.numel()} values, expected {want} (the sample's length)")
        t = t[:b - a] if shared else t[pb - pa:]
        parts.append(t)
        ref = t
    pad = mb.num_tokens - int(mb.cu_seqlens[-1])
    dtype = ref.dtype if ref is not None else torch.float32
    device = ref.device if ref is not None else mb.tokens.device
    parts.append(torch.zeros(pad, dtype=dtype, device=device))
    return torch.cat(parts)


_PER_SAMPLE_FIELDS = ("old_logprobs", "ref_logprobs", "old_values", "returns")


def attach_per_sample(
    micro_batches: Iterable[MicroBatch],
    name: Literal["old_logprobs", "ref_logprobs", "old_values", "returns"],
    per_sample: Sequence[torch.Tensor],
) -> None:
    """Set mb.<name> (detached float32) on each micro-batch from per-sample [T_i] tensors indexed
    like the step's sample list. For the pack_step output pass
    `[mb for rank in packed for mb in rank]` (or one rank's list)."""
    if name not in _PER_SAMPLE_FIELDS:
        raise ValueError(f"attach_per_sample: name={name!r}, expected one of {_PER_SAMPLE_FIELDS}")
    for mb in micro_batches:
        setattr(mb, name, gather_per_sample(mb, per_sample).detach().to(torch.float32))


def set_advantages(micro_batches: Iterable[MicroBatch], samples: Sequence[Sample]) -> None:
    """Refresh mb.advantages of packed micro-batches from the samples' advantages (computed after
    the packing, e.g. from a forward pass over it): the values `pack_step` would have written,
    each token's advantage times its loss mask."""
    per_sample = [torch.tensor(token_advantages(s, i), dtype=torch.float32)
                  * torch.tensor([1.0 if x else 0.0 for x in s.loss_mask], dtype=torch.float32)
                  for i, s in enumerate(samples)]
    for mb in micro_batches:
        mb.advantages = gather_per_sample(mb, per_sample)


def unpack_per_sample(
    micro_batches: Sequence[MicroBatch], per_token: Sequence[torch.Tensor], num_samples: Optional[int] = None
) -> list[torch.Tensor]:
    """Per-micro-batch [S] outputs (e.g. trainer logprobs) -> one [T_i] tensor per sample, indexed
    by sample id. micro_batches and per_token are aligned flat lists covering every sample of the
    step exactly once (`[mb for rank in packed for mb in rank]`); num_samples defaults to the
    largest sample id + 1. Missing or duplicated samples are an error."""
    if len(micro_batches) != len(per_token):
        raise ValueError(
            f"unpack_per_sample: {len(micro_batches)} micro-batches but {len(per_token)} per-token tensors"
        )
    found: dict[int, torch.Tensor] = {}
    for k, (mb, t) in enumerate(zip(micro_batches, per_token)):
        if t.shape[:1] != (mb.num_tokens,):
            raise ValueError(
                f"unpack_per_sample: per_token[{k}] has shape {tuple(t.shape)}, expected ({mb.num_tokens}, ...)"
            )
        for i, a, b, pa, pb in _segments(mb):
            if i == SHARED:
                continue
            if i in found:
                raise ValueError(f"unpack_per_sample: sample {i} appears in more than one micro-batch")
            found[i] = t[a:b] if pb == pa else torch.cat([t[pa:pb], t[a:b]])
    n = num_samples if num_samples is not None else (max(found) + 1 if found else 0)
    missing = [i for i in range(n) if i not in found]
    if missing or len(found) != n:
        raise ValueError(
            f"unpack_per_sample: samples {missing[:10]} missing (expected ids 0..{n - 1}, got {len(found)})"
        )
    return [found[i] for i in range(n)]

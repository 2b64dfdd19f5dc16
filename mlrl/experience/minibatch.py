"""Splitting one RL step's samples into mini-batches (one optimizer update each).

A mini-batch holds whole prompt groups (Sample.group_id): group-relative quantities were already
computed over the whole step, and keeping a group together keeps sequence/group-level metrics
meaningful per update. Groups are dealt in their order of first appearance, as evenly as
possible (sizes differ by at most one group when the groups do not divide evenly, e.g. after
dynamic sampling kept fewer groups than prompts_per_step).
"""

from __future__ import annotations

from typing import Sequence

from mlrl.types import Sample


def split_groups(samples: Sequence[Sample], num_mini_batches: int) -> list[list[int]]:
    """Indices into `samples` for each mini-batch (in sample order within a mini-batch).

    Returns min(num_mini_batches, number of groups) non-empty lists; every sample appears once.
    """
    if num_mini_batches < 1:
        raise ValueError(f"trainer.mini_batches_per_step={num_mini_batches}: expected >= 1")
    order: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        order.setdefault(s.group_id, []).append(i)
    groups = list(order.values())
    n = min(num_mini_batches, len(groups))
    if n == 0:
        return []
    base, extra = divmod(len(groups), n)
    out, g = [], 0
    for k in range(n):
        take = base + (1 if k < extra else 0)
        out.append(sorted(i for grp in groups[g:g + take] for i in grp))
        g += take
    return out

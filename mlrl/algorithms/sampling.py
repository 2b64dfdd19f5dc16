"""DAPO's data-side tricks (Yu et al. 2025): dynamic sampling and overlong reward shaping.

Dynamic sampling: a group whose answers all scored the same has no group-relative signal about
the task, so it adds compute and no useful gradient (and shrinks the effective batch);
`filter_groups` drops such groups and reports how many, so the loop can sample more prompts until
the batch is full again. It compares the workflow's own scores (`Sample.task_reward`), not the
length-shaped ones: a group of equally correct answers that differ only in their overlong
penalty is dropped, as the paper's `0 < |{correct}| < G` and verl's DAPO recipe
(`filter_groups.metric=acc`) drop it. Filtering on the shaped reward kept such groups, and the
group std turned a small length penalty into full-size advantages.

Overlong shaping: a truncated answer is penalised smoothly inside a buffer before the length
limit instead of abruptly at it. The length is the sample's longest generation (its longest run of
policy tokens), which is what `rollout.sampling.max_new_tokens` limits: one request per run of
policy tokens in every built-in workflow, so a multi-turn episode is not penalised for the
number of its turns. Both functions keep the order of the samples they keep.
"""

from __future__ import annotations

from typing import Sequence

from mlrl.types import OVERLONG_PENALTY_KEY, Sample


def filter_groups(samples: Sequence[Sample], atol: float = 0.0) -> tuple[list[Sample], int]:
    """Drop every group (same Sample.group_id) whose task rewards (the workflow's scores, before
    overlong shaping) all lie within atol of each other.

    Returns (kept samples in their original order, number of dropped GROUPS). A group of one
    sample is dropped too: it has no spread, hence no group-relative signal.
    """
    by_group: dict[str, list[float]] = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s.task_reward)
    flat = {g for g, rs in by_group.items() if max(rs) - min(rs) <= atol}
    return [s for s in samples if s.group_id not in flat], len(flat)


def overlong_penalty(response_len: int, max_len: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO soft overlong punishment, added to the reward:

        0                                            if |y| <= L_max - L_buf
        max(((L_max - L_buf) - |y|) / L_buf, -penalty)  otherwise

    With penalty = 1 this is the paper's formula (-1 at and beyond L_max). A smaller penalty caps
    the punishment earlier; verl's overlong_penalty_factor instead scales the slope. buffer = 0
    turns shaping off (0 for every length).
    """
    if buffer < 0 or max_len <= 0 or buffer > max_len:
        raise ValueError(
            f"overlong shaping: got max_len={max_len}, buffer={buffer}; expected 0 <= buffer <= max_len, max_len > 0"
        )
    if penalty < 0:
        raise ValueError(f"algorithm.overlong_penalty={penalty}: expected >= 0")
    start = max_len - buffer
    if buffer == 0 or response_len <= start:
        return 0.0
    return max((start - response_len) / buffer, -penalty)


def longest_generation(s: Sample) -> int:
    """The sample's longest run of policy tokens: the response length of a single-turn sample, the
    longest turn of a multi-turn one (each turn is one request, limited by max_new_tokens)."""
    best = run = 0
    for m in s.loss_mask:
        run = run + 1 if m else 0
        best = max(best, run)
    return best


def apply_overlong_shaping(samples: Sequence[Sample], max_len: int, buffer: int, penalty: float = 1.0) -> int:
    """Add overlong_penalty to each sample's reward in place; |y| is its longest generation
    (`longest_generation`: the response length for single-turn samples, the longest turn for
    multi-turn ones, as `max_len` limits each request). The penalty is also recorded in
    Sample.metadata["overlong_penalty"]. Returns how many samples were penalised."""
    n = 0
    for s in samples:
        p = overlong_penalty(longest_generation(s), max_len, buffer, penalty)
        s.metadata[OVERLONG_PENALTY_KEY] = p
        if p < 0:
            s.reward = float(s.reward) + p
            n += 1
    return n

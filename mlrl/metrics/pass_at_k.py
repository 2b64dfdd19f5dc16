"""pass@k for held-out evaluation (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code", Sec. 2.1): with n samples of a prompt of which c are correct, the unbiased estimator of the
probability that at least one of k samples is correct is

    pass@k = 1 - C(n - c, k) / C(n, k)          (n >= k; 1 when n - c < k)

computed as the paper's numerically stable product 1 - prod_{i=n-c+1}^{n} (1 - k / i), and
averaged over prompts. pass@1 reduces to c / n.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from mlrl.types import EpisodeStatus

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with n samples, c of them correct."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"pass_at_k: got n={n}, c={c}, k={k}; expected 0 <= c <= n and k >= 1")
    if k > n:
        raise ValueError(f"pass_at_k: k={k} exceeds the n={n} samples drawn for the prompt")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(per_prompt: Sequence[tuple[int, int]], k: int) -> float:
    """Mean over prompts of pass_at_k(n, c, k), given (n, c) per prompt."""
    if not per_prompt:
        raise ValueError("mean_pass_at_k: no prompts")
    return sum(pass_at_k(n, c, k) for n, c in per_prompt) / len(per_prompt)


def episode_passes(episode: Any, threshold: float) -> bool:
    """An evaluation episode counts as correct: it completed and its reward is >= threshold
    (eval.correct_threshold)."""
    return episode.status == EpisodeStatus.COMPLETED and episode.reward is not None and episode.reward >= threshold


def pass_metrics(groups: Sequence[Any], k: int, threshold: float) -> dict[str, float]:
    """pass@1 / pass@k / mean reward of evaluation groups (mlrl.workflow.runner.GroupResult); an
    episode that did not complete counts as incorrect (and as reward 0), and so does each of the k
    episodes a group is short of (a workflow's `arun_group` may return fewer, e.g. Trinity's
    adapter when a run yields nothing). Rows with a `data_source` (a data.mix source) also get
    them per source, as `eval/source/<name>/...`."""
    out = _pass_metrics(groups, k, threshold)
    for name, gs in by_source(groups).items():
        out.update({f"eval/source/{name}/{key.removeprefix('eval/')}": v
                    for key, v in _pass_metrics(gs, k, threshold).items()})
    return out


MAX_SOURCES = 32  # sources broken out in one batch's metrics (a data_source column used as an id is not)


def by_source(groups: Sequence[Any]) -> dict[str, list[Any]]:
    """Groups by their row's `data_source` (a data.mix source, or a dataset's own column), named for
    metric keys (characters other than letters, digits, `_`, `-`, `.` become `_`), in order of first
    appearance; {} when no row has one, or when the batch has more than MAX_SOURCES of them."""
    out: dict[str, list[Any]] = {}
    for g in groups:
        source = g.data.get("data_source") if isinstance(g.data, dict) else None
        if isinstance(source, str) and source.strip():
            out.setdefault(_UNSAFE.sub("_", source.strip()), []).append(g)
    return out if len(out) <= MAX_SOURCES else {}


def _pass_metrics(groups: Sequence[Any], k: int, threshold: float) -> dict[str, float]:
    per_prompt, rewards = [], []
    for g in groups:
        ok = [episode_passes(e, threshold) for e in g.episodes]
        missing = max(0, k - len(ok))
        per_prompt.append((len(ok) + missing, sum(ok)))
        rewards += [
            e.reward if e.status == EpisodeStatus.COMPLETED and e.reward is not None else 0.0 for e in g.episodes
        ] + [0.0] * missing
    if not per_prompt:
        return {}
    out = {"eval/pass@1": mean_pass_at_k(per_prompt, 1), "eval/pass@k": mean_pass_at_k(per_prompt, k),
           "eval/mean_reward": sum(rewards) / len(rewards)}
    out[f"eval/pass@{k}"] = out["eval/pass@k"]
    return out

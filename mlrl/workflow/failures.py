"""Stopping a run whose episodes fail: `FailureGuard` watches each training step's episodes.

A workflow bug (a wrong input type, a reward that raises, an unreachable tool) fails every
episode of every step. Recorded per episode, such failures would otherwise let the run go on
with nothing to train on, write checkpoints and exit 0. The guard raises `EpisodeFailures` (the
launcher exits 1 with its message) when
- every episode of a step failed: ended in an error or a timeout, or completed without any of its
  reward calls giving a score (each failed or timed out; the reward wrapper scores such a call
  0.0, so a reward that raises on every row trained the policy on zeros to the end of the run), or
- more than `workflow.max_failure_fraction` of them failed (error or timeout) in each of
  `workflow.max_failure_steps` consecutive steps. A reward failing on some rows only is left to
  the metrics (`reward_fn/failures`): a judge's unparsed reply is such a failure, and scoring it
  0.0 is the signal the policy learns from.
The message carries the first failed episode's error (and traceback) or reward failure.
A training run's held-out evaluation episodes are not watched (they never train); an evaluation run
(mlrl.jobs.evaluate) observes its one batch, after writing its answers and metrics.
"""

from __future__ import annotations

from typing import Sequence

from mlrl.workflow.api import EpisodeStatus
from mlrl.workflow.runner import EpisodeResult, GroupResult

FAILED = (EpisodeStatus.ERROR, EpisodeStatus.TIMEOUT)


class EpisodeFailures(RuntimeError):
    """The run stops: its episodes fail (see the module doc)."""


class FailureGuard:
    def __init__(self, max_fraction: float, max_steps: int, *, outcome: str = "the run stops without training on them"):
        self.max_fraction, self.max_steps = max_fraction, max_steps
        self.outcome = outcome  # what the message says happens
        self.streak = 0  # consecutive steps above max_fraction

    def observe(self, step: int, groups: Sequence[GroupResult], *, label: str | None = None) -> None:
        """`label`: how the message names the batch (default "step <step>")."""
        episodes = [e for g in groups for e in g.episodes]
        failed = [e for e in episodes if e.status in FAILED]
        if not episodes:
            return
        share = len(failed) / len(episodes)
        self.streak = self.streak + 1 if share > self.max_fraction else 0
        unscored = [e for e in episodes if _reward_failed(e)]
        if len(failed) + len(unscored) == len(episodes):
            failed += unscored
            why = f"{label or f'step {step}'}: all {len(episodes)} episodes failed"
        elif self.streak >= self.max_steps:
            why = (f"{label or f'step {step}'}: {len(failed)} of {len(episodes)} episodes failed, more than "
                   f"workflow.max_failure_fraction={self.max_fraction}")
            if label is None:  # (a one-off batch, e.g. an evaluation, has no streak)
                why += f" for {self.streak} steps in a row (workflow.max_failure_steps={self.max_steps})"
        else:
            return
        raise EpisodeFailures(f"{why}; {self.outcome}.\n{describe(failed[0])}")


def _reward_failed(e: EpisodeResult) -> bool:
    """A completed episode none of whose reward calls gave a score (each scored 0.0). A group's
    episodes share one counter (a group-native workflow scores them together): they count
    together, only when all of the group's calls failed."""
    return e.status == EpisodeStatus.COMPLETED and e.reward_stats.all_failed


def describe(episode: EpisodeResult) -> str:
    """The first line of the error and its traceback, as the runner recorded them."""
    if _reward_failed(episode):
        rs = episode.reward_stats
        return f"first failure: all {rs.calls} reward calls of the episode failed; the first: {rs.first_error}"
    if episode.status == EpisodeStatus.TIMEOUT:
        return "first failure: the episode timed out (workflow.episode_timeout_s)"
    err = episode.info.get("error", {})
    tb = err.get("traceback") or ""
    return f"first failure: {err.get('error_type', 'error')}: {err.get('error_message', '')}\n{tb}".rstrip()

"""Stopping a run whose episodes fail: `FailureGuard` watches each training step's episodes.

A workflow bug (a wrong input type, a reward that raises, an unreachable tool) fails every
episode of every step. Recorded per episode, such failures would otherwise let the run go on
with nothing to train on, write checkpoints and exit 0. The guard raises `EpisodeFailures`
(the launcher exits 1 with its message) when
- every episode of a step failed (error or timeout), or
- more than `workflow.max_failure_fraction` of them failed in each of `workflow.max_failure_steps`
  consecutive steps.
The message carries the first failed episode's error and traceback. Evaluation episodes are not
watched (they never train).
"""

from __future__ import annotations

from typing import Sequence

from mlrl.workflow.api import EpisodeStatus
from mlrl.workflow.runner import EpisodeResult, GroupResult

FAILED = (EpisodeStatus.ERROR, EpisodeStatus.TIMEOUT)


class EpisodeFailures(RuntimeError):
    """The run stops: its episodes fail (see the module doc)."""


class FailureGuard:
    def __init__(self, max_fraction: float, max_steps: int):
        self.max_fraction, self.max_steps = max_fraction, max_steps
        self.streak = 0  # consecutive steps above max_fraction

    def observe(self, step: int, groups: Sequence[GroupResult]) -> None:
        episodes = [e for g in groups for e in g.episodes]
        failed = [e for e in episodes if e.status in FAILED]
        if not episodes:
            return
        share = len(failed) / len(episodes)
        self.streak = self.streak + 1 if share > self.max_fraction else 0
        if len(failed) == len(episodes):
            why = f"step {step}: all {len(episodes)} episodes failed"
        elif self.streak >= self.max_steps:
            why = (f"step {step}: {len(failed)} of {len(episodes)} episodes failed, more than "
                   f"workflow.max_failure_fraction={self.max_fraction} for {self.streak} steps in a row "
                   f"(workflow.max_failure_steps={self.max_steps})")
        else:
            return
        raise EpisodeFailures(f"{why}; the run stops without training on them.\n{describe(failed[0])}")


def describe(episode: EpisodeResult) -> str:
    """The first line of the error and its traceback, as the runner recorded them."""
    if episode.status == EpisodeStatus.TIMEOUT:
        return "first failure: the episode timed out (workflow.episode_timeout_s)"
    err = episode.info.get("error", {})
    tb = err.get("traceback") or ""
    return f"first failure: {err.get('error_type', 'error')}: {err.get('error_message', '')}\n{tb}".rstrip()

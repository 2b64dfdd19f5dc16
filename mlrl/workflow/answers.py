"""Answer records: one JSON object per episode of a held-out prompt (what was asked, what the
model answered, its reward and whether it counts as correct for pass@k). The evaluation job
(mlrl.jobs.evaluate) writes them as its groups finish; a training run writes each held-out
evaluation's to `<run_dir>/eval/step_N.jsonl` with eval.save_answers."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from mlrl.metrics.pass_at_k import episode_passes
from mlrl.types import EpisodeStatus, SampleStatus
from mlrl.workflow.runner import GroupResult


class AnswerWriter:
    """The answers file: one JSON object per episode, flushed per group."""

    def __init__(self, f: TextIO, tokenizer: Any, threshold: float):
        self.f, self.tokenizer, self.threshold = f, tokenizer, threshold

    def write(self, index: int, group: GroupResult) -> None:
        for j, e in enumerate(group.episodes):
            self.f.write(json.dumps(answer_record(index, j, group.data, e, self.tokenizer, self.threshold),
                                    default=str) + "\n")
        self.f.flush()


def answer_record(index: int, sample: int, row: dict[str, Any], episode: Any, tokenizer: Any,
                  threshold: float) -> dict[str, Any]:
    """One answer: the prompt (the row's messages) and its reference answer, the response as text
    (the generated part of the episode's last sample, special tokens dropped: a multi-turn episode
    exported as one sample includes its tool turns, one exported per turn gives its last turn),
    `response_tokens` (the generated tokens of all its samples), its reward and whether it counts
    as correct for pass@k."""
    completed = episode.status == EpisodeStatus.COMPLETED
    last = episode.samples[-1] if episode.samples else None
    rec: dict[str, Any] = {
        "prompt_index": index,
        "sample": sample,
        "messages": row.get("messages"),
        "answer": row.get("answer"),
        "response": tokenizer.decode(last.tokens[last.prompt_len:], skip_special_tokens=True) if last else None,
        "response_tokens": sum(s.num_loss_tokens for s in episode.samples),
        "reward": episode.reward if completed else None,
        "correct": episode_passes(episode, threshold),
        "status": episode.status.value,
        "truncated": any(s.status == SampleStatus.TRUNCATED for s in episode.samples),
    }
    if isinstance(row.get("data_source"), str):  # a mixture's source (data.mix)
        rec["data_source"] = row["data_source"]
    err = episode.info.get("error")
    if isinstance(err, dict):
        rec["error"] = f"{err.get('error_type', 'error')}: {err.get('error_message', '')}"
    return rec


def write_answers_file(path: Path, groups: Sequence[GroupResult], tokenizer: Any, threshold: float) -> None:
    """All answers of `groups` (prompt index = position), written whole: beside `path`, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        writer = AnswerWriter(f, tokenizer, threshold)
        for i, g in enumerate(groups):
            writer.write(i, g)
        os.fsync(f.fileno())
    os.replace(tmp, path)

"""RL rows: validation, normalisation, and the dataset container the RL loop iterates.

An RL row is `{"messages": [{"role", "content"}, ...], "answer": ..., **metadata}`; every key
reaches the reward function as a keyword argument. Rows may instead give the prompt as `prompt`
(a string, or a list of messages) or `question` (a string); they are normalised to `messages`
and the original keys are kept (Trinity-style workflows read `question` directly).

A malformed row raises `DatasetError` naming the file and line (or row), or — with
`skip_malformed` — is dropped and counted with its reason in `RLDataset.skipped`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool", "developer")


class DatasetError(ValueError):
    """A dataset cannot be found, read, or one of its rows is malformed."""


def normalise_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise DatasetError(
            f"{where}: 'messages' must be a non-empty list of {{role, content}} objects, got {_short(messages)}"
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DatasetError(f"{where}: messages[{i}] must be an object, got {_short(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise DatasetError(f"{where}: messages[{i}].role must be one of {', '.join(ROLES)}, got {_short(role)}")
        if not isinstance(content, str):
            raise DatasetError(f"{where}: messages[{i}].content must be a string, got {_short(content)}")
        out.append(dict(m))
    return out


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def normalise_rl_row(row: Any, where: str, require_answer: bool = True) -> dict[str, Any]:
    """The row with a validated `messages` list (built from `prompt` / `question` if needed)."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a JSON object, got {_short(row)}")
    out = dict(row)
    if "messages" in row:
        out["messages"] = normalise_messages(row["messages"], where)
    elif isinstance(row.get("prompt"), list):
        out["messages"] = normalise_messages(row["prompt"], where)
    elif isinstance(row.get("prompt"), str) or isinstance(row.get("question"), str):
        text = row["prompt"] if isinstance(row.get("prompt"), str) else row["question"]
        out["messages"] = [{"role": "user", "content": text}]
    else:
        raise DatasetError(f"{where}: the row has no 'messages' (or 'prompt' / 'question'); keys: {sorted(row)}")
    if require_answer and out.get("answer") is None and out.get("tests") is None:
        raise DatasetError(f"{where}: the row has no 'answer' (the reference the reward compares with; "
                           "or 'tests', for the code_tests reward)")
    return out


SOURCE_KEY = "data_source"  # a mixture's rows: the source they came from (data.mix[i].name)


@dataclass(frozen=True)
class SourceSpan:
    """One source of a mixed RLDataset: its rows are `rows[start:start + size]`; `weight` its share
    of each epoch (None: its rows once per epoch)."""

    name: str
    start: int
    size: int
    weight: float | None = None


@dataclass
class RLDataset(Sequence):
    """Prompt rows for RL (a list of dicts) plus what loading dropped."""

    rows: list[dict[str, Any]]
    name: str = ""
    split: str = "train"
    skipped: list[str] = field(default_factory=list)   # "<file>:<line>: <reason>" per dropped malformed row
    too_long: int = 0                                   # prompts dropped for exceeding max_length tokens
    reward: str | None = None                           # the reward this dataset is made for, when known
    longest_prompt: int = 0                             # tokens of the longest kept prompt (chat template
    #                                                     applied; 0 when loaded without a tokenizer)
    sources: list[SourceSpan] = field(default_factory=list)  # a mixture's sources (data.mix), in row order

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: Any) -> Any:
        return self.rows[i]

    def batches(self, batch_size: int, *, epoch: int = 0, seed: int = 0, shuffle: bool = True,
                drop_last: bool = True) -> Iterator[list[dict[str, Any]]]:
        """One epoch of prompt batches; the order depends only on (seed, epoch)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        order = list(range(len(self.rows)))
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for i in range(0, len(order), batch_size):
            idx = order[i : i + batch_size]
            if len(idx) < batch_size and drop_last:
                return
            yield [self.rows[j] for j in idx]

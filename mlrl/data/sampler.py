"""Resumable prompt order: epoch-wise seeded shuffles, position saved in checkpoints.

Invariant: the sequence of rows handed out is a pure function of (seed, dataset length,
shuffle), and `state()` / `from_state()` capture the position exactly, so a resumed run sees no
prompt twice and skips none (within an epoch and across epoch boundaries).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

log = logging.getLogger(__name__)
ROW_INDEX_KEY = "__mlrl_dataset_index__"  # a row recorded by its position in the training data (`portable`)


@dataclass
class SamplerState:
    epoch: int = 0
    index: int = 0      # position inside the epoch's permutation
    consumed: int = 0   # rows handed out in total
    rows: int = 0       # the dataset's length the position refers to (0: a checkpoint from before it was saved)
    mix: list[list[Any]] = field(default_factory=list)  # a mixture's sources (data.mix): [name, rows, per epoch]


class PromptSampler:
    def __init__(self, rows: Sequence[Any], *, seed: int, shuffle: bool = True, state: SamplerState | None = None):
        if len(rows) == 0:
            raise ValueError("the training dataset is empty")
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self._state = SamplerState(**vars(state)) if state else SamplerState()
        if self._state.rows and self._state.rows != len(rows):  # (a deliberate change of data is allowed: said)
            log.warning("resume: the saved prompt position is one in %d rows, and the training data has %d now "
                        "(data.train, data.num_synthetic or data.max_prompt_tokens changed): the shuffled order "
                        "changes from here, so this epoch repeats some prompts and skips others", self._state.rows,
                        len(rows))
        self._state.rows = len(rows)
        mix = [[s.name, s.size, q] for s, q in zip(getattr(rows, "sources", None) or [], self.quotas())]
        if self._state.mix and self._state.mix != mix:
            log.warning("resume: the saved prompt position is one in a mixture of %s ([source, rows, prompts per "
                        "epoch]), and data.mix is %s now (its sources, their data or weights changed): the order "
                        "changes from here", self._state.mix, mix)
        self._state.mix = mix
        self._perm = self._permutation(self._state.epoch)
        self._index_of: dict[int, int] | None = None  # id(row) -> its position (portable), built on first use

    def _permutation(self, epoch: int) -> list[int]:
        spans = getattr(self.rows, "sources", None)
        if spans:
            return self._mix_order(spans, epoch)
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def quotas(self) -> list[int]:
        """A mixture's prompts per epoch from each source (data.mix): its weight's share of all the
        mix's rows (at least 1), or, without weights, its own rows."""
        spans = getattr(self.rows, "sources", None) or []
        if not spans or all(s.weight is None for s in spans):
            return [s.size for s in spans]
        total, wsum = sum(s.size for s in spans), sum(s.weight for s in spans)
        return [max(1, round(s.weight / wsum * total)) for s in spans]

    def _mix_order(self, spans: Sequence[Any], epoch: int) -> list[int]:
        """Epoch `epoch` of a mixture: each source's next `quota` rows from its own stream (pass after
        pass of its rows, each pass in its own seeded order), then shuffled together; without shuffle,
        each source in its order, interleaved evenly. A pure function of (seed, epoch, the sources)."""
        picked: list[tuple[float, int, int]] = []
        for k, (span, n) in enumerate(zip(spans, self.quotas())):
            passes: dict[int, list[int]] = {}
            for i, pos in enumerate(range(epoch * n, (epoch + 1) * n)):
                p, j = divmod(pos, span.size)
                if p not in passes:
                    passes[p] = list(range(span.size))
                    if self.shuffle:
                        random.Random(f"mix:{self.seed}:{k}:{p}").shuffle(passes[p])
                picked.append(((i + 0.5) / n, k, span.start + passes[p][j]))
        if self.shuffle:
            order = [row for _, _, row in picked]
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            return order
        return [row for _, _, row in sorted(picked)]

    def next_batch(self, n: int) -> list[Any]:
        out = []
        while len(out) < n:
            if self._state.index >= len(self._perm):
                self._state.epoch += 1
                self._state.index = 0
                self._perm = self._permutation(self._state.epoch)
            out.append(self.rows[self._perm[self._state.index]])
            self._state.index += 1
            self._state.consumed += 1
        return out

    def state(self) -> dict[str, Any]:
        return {**vars(self._state), "mix": [list(m) for m in self._state.mix]}

    def portable(self, rows: Sequence[Any]) -> list[Any]:
        """`rows` (handed out by this sampler) as a checkpoint records them: by their position in
        the dataset, since a row's values need not be JSON (a parquet timestamp or binary column
        made the save's commit fail); a row that is not the dataset's own object, as it is."""
        if self._index_of is None:
            self._index_of = {id(r): i for i, r in enumerate(self.rows)}
        out = []
        for r in rows:
            i = self._index_of.get(id(r))
            out.append({ROW_INDEX_KEY: i} if i is not None and self.rows[i] is r else r)
        return out

    def restore(self, saved: Sequence[Any]) -> list[Any]:
        """The rows `portable` recorded (rows recorded whole, by older checkpoints too, as they are)."""
        out = []
        for r in saved:
            if isinstance(r, dict) and set(r) == {ROW_INDEX_KEY}:
                i = r[ROW_INDEX_KEY]
                if not isinstance(i, int) or not 0 <= i < len(self.rows):
                    raise ValueError(f"the checkpoint's in-flight row {i} is not in the training data "
                                     f"({len(self.rows)} rows): data.train changed since the save")
                out.append(self.rows[i])
            else:
                out.append(r)
        return out

    @classmethod
    def from_state(
        cls, rows: Sequence[Any], state: dict[str, Any], *, seed: int, shuffle: bool = True
    ) -> "PromptSampler":
        return cls(rows, seed=seed, shuffle=shuffle, state=SamplerState(**state))

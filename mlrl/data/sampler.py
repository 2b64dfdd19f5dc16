"""Resumable prompt order: epoch-wise seeded shuffles, position saved in checkpoints.

Invariant: the sequence of rows handed out is a pure function of (seed, dataset length,
shuffle), and `state()` / `from_state()` capture the position exactly, so a resumed run sees no
prompt twice and skips none (within an epoch and across epoch boundaries).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass
class SamplerState:
    epoch: int = 0
    index: int = 0      # position inside the epoch's permutation
    consumed: int = 0   # rows handed out in total


class PromptSampler:
    def __init__(self, rows: Sequence[Any], *, seed: int, shuffle: bool = True, state: SamplerState | None = None):
        if len(rows) == 0:
            raise ValueError("the training dataset is empty")
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self._state = SamplerState(**vars(state)) if state else SamplerState()
        self._perm = self._permutation(self._state.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

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

    def state(self) -> dict[str, int]:
        return dict(vars(self._state))

    @classmethod
    def from_state(
        cls, rows: Sequence[Any], state: dict[str, int], *, seed: int, shuffle: bool = True
    ) -> "PromptSampler":
        return cls(rows, seed=seed, shuffle=shuffle, state=SamplerState(**state))

"""Named wall-clock timers for the phases of a step (`with timer("rollout"): ...`)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class Timer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out = {f"time/{k}_s": v for k, v in self.totals.items()}
        self.totals = {}
        return out

"""Where the seconds of a step go: `timing/*` metrics that sum to the step's wall time.

Two clocks:
- `StepTimer`: the sequential phases of one step (`with timer("train"): ...`), and the step's
  wall time, measured from the end of the previous step (so the previous step's checkpoint, which
  runs after its metrics line is written, lands in this step's line as `timing/checkpoint`).
- `ACTIVITY` (an `ActivityClock`): busy time of activities that run concurrently inside a phase,
  recorded where they happen: "generate" (at least one engine request in flight, recorded by the
  episode runner) and "reward" (at least one reward call running, recorded by the reward wrapper).

`StepTimer.finish` turns both into the step's breakdown:

    timing/rollout     sync: seconds the engines were generating during the rollout phase;
                       async: seconds the trainer waited for samples (generation overlaps training)
    timing/reward      sync: seconds reward functions ran while no generation was in flight
                       (sub-key /model: seconds a served judge, reward_model, had a call in flight)
    timing/logprobs    old / reference logprobs, critic values (trainer forward passes)
    timing/train       the optimizer updates (sub-keys timing/train/forward_backward, /optimizer
                       measured on the trainer ranks, /driver = the rest: packing, RPC, pickling)
    timing/sync        weight sync (sub-keys /pause, /transfer, /apply, /verify)
    timing/eval        held-out evaluation
    timing/checkpoint  the previous step's checkpoint save / HF export
    timing/sleep, /wake      colocated placement (mlrl.colocation): engines put to sleep / woken
    timing/offload, /reload  colocated: trainer state moved off / back onto its devices
    timing/other       wall - the sum of the above (the runner's own work in the rollout phase,
                       the loop, logging)
    timing/step        the step's wall time; timing/overlap (async): generation busy while the
                       trainer computed

Only the keys directly under `timing/` (no second slash) besides step and overlap add up to the
wall time; the sub-keys split their parent.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

PHASES = ("rollout", "reward", "logprobs", "train", "sync", "eval", "checkpoint", "sleep", "reload", "offload", "wake")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in _union(intervals))


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for a, b in _union(xs):
        for c, d in _union(ys):
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                out.append((lo, hi))
    return out


class ActivityClock:
    """Busy intervals of named activities that may run many at a time (coroutines, threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, tuple[int, float]] = {}        # name -> (running count, busy since)
        self._done: dict[str, list[tuple[float, float]]] = {}

    @contextmanager
    def busy(self, name: str) -> Iterator[None]:
        with self._lock:
            n, since = self._open.get(name, (0, 0.0))
            self._open[name] = (n + 1, time.perf_counter() if n == 0 else since)
        try:
            yield
        finally:
            with self._lock:
                n, since = self._open[name]
                if n == 1:
                    del self._open[name]
                    self._done.setdefault(name, []).append((since, time.perf_counter()))
                else:
                    self._open[name] = (n - 1, since)

    def intervals(self, name: str, start: float, end: float) -> list[tuple[float, float]]:
        """Busy intervals of `name` clipped to [start, end] (a running activity counts up to `end`)."""
        with self._lock:
            spans = list(self._done.get(name, []))
            if name in self._open:
                spans.append((self._open[name][1], end))
        return [(max(a, start), min(b, end)) for a, b in spans if min(b, end) > max(a, start)]

    def forget_before(self, t: float) -> None:
        """Drop finished intervals that ended before `t` (called once per step)."""
        with self._lock:
            for name, spans in self._done.items():
                self._done[name] = [s for s in spans if s[1] >= t]


ACTIVITY = ActivityClock()


class StepTimer:
    """The phases of one step. `start`: when the step began (the previous step's end)."""

    def __init__(self, start: float | None = None, clock: ActivityClock = ACTIVITY) -> None:
        self.start = time.perf_counter() if start is None else start
        self.clock = clock
        self.totals: dict[str, float] = {}
        self.windows: dict[str, list[tuple[float, float]]] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.totals[name] = self.totals.get(name, 0.0) + t1 - t0
            self.windows.setdefault(name, []).append((t0, t1))

    def add(self, name: str, seconds: float) -> None:
        """Time spent on `name` outside this timer (e.g. the previous step's checkpoint)."""
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    def finish(self, *, overlapped_rollout: bool = False, details: dict[str, float] | None = None) -> dict[str, float]:
        """The step's `timing/*` metrics; `overlapped_rollout` (async mode): the rollout phase was
        the wait for samples generated in the background."""
        end = time.perf_counter()
        out = {f"timing/{k}": v for k, v in self.totals.items() if k in PHASES}
        rollout = self.windows.get("rollout", [])
        if rollout and not overlapped_rollout:
            gen = _intersect([i for a, b in rollout for i in self.clock.intervals("generate", a, b)], rollout)
            rew = _intersect([i for a, b in rollout for i in self.clock.intervals("reward", a, b)], rollout)
            out["timing/rollout"] = _length(gen)
            out["timing/reward"] = _length(rew) - _length(_intersect(rew, gen))
            out["timing/rollout/phase"] = self.totals["rollout"]
        judge = self.clock.intervals("reward_model", self.start, end)
        if judge:  # reward_model: seconds a served judge had a call in flight (part of rollout / reward)
            out["timing/reward/model"] = _length(judge)
        if overlapped_rollout:
            busy = [w for k in ("logprobs", "train") for w in self.windows.get(k, [])]
            gen = self.clock.intervals("generate", self.start, end)
            out["timing/overlap"] = _length(_intersect(gen, busy))
        for k, v in (details or {}).items():
            out[f"timing/{k}"] = v
        wall = end - self.start
        out["timing/other"] = wall - sum(out.get(f"timing/{p}", 0.0) for p in PHASES)
        out["timing/step"] = wall
        self.clock.forget_before(self.start)
        return out


def timing_table(history: list[dict[str, float]]) -> str:
    """The end-of-run summary: mean seconds per step of every timing/* key (the first step, which
    includes warm-up, shown apart), and each phase's share of the step."""
    steps = [h for h in history if "timing/step" in h]
    if not steps:
        return ""
    keys = sorted({k for h in steps for k in h if k.startswith("timing/")},
                  key=lambda k: (k == "timing/step", k.count("/") > 1, k))
    rest = steps[1:] or steps
    wall = sum(h["timing/step"] for h in rest) / len(rest)
    lines = [f"{'timing (s/step)':<30}{'step 1':>9}{'mean, later':>13}{'share':>8}"]
    for k in keys:
        later = sum(h.get(k, 0.0) for h in rest) / len(rest)
        top = k.count("/") == 1 and k not in ("timing/step", "timing/overlap")
        share = f"{100 * later / wall:7.1f}%" if top and wall > 0 else ""
        lines.append(f"{k:<30}{steps[0].get(k, 0.0):>9.3f}{later:>13.3f}{share:>8}")
    return "\n".join(lines)

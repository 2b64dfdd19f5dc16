"""When the RL loop saves: `SaveSchedule` decides, after each step, whether a training checkpoint
and / or a Hugging Face export is due (checkpoint.save_every / hf_export_every / save_at_end /
hf_export_at_end), makes it through the `Checkpointer`, and commits an async save once every rank
has finalized it (a non-blocking poll each step).

It runs after the step's metrics line is written, so a checkpoint never exists for a step whose
metrics are missing; its time is reported in the next step's line as timing/checkpoint
(`take_seconds`). Colocated (the trainer's state is off its devices while the engines hold them),
a save due at step k is deferred to step k+1's training phase (`run_deferred`, engines asleep, the
weights still step k's), or, after the last step, made at once after putting the engines to sleep.
A run that stops before step k+1's training phase makes it at exit (mlrl.jobs.rl, once the engines
are shut down).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from mlrl.config.schema import CheckpointConfig
from mlrl.interfaces import Checkpointer
from mlrl.metrics import StepTimer


class Colocated(Protocol):
    """What the schedule needs of mlrl.colocation.Colocation: the devices back to the trainer."""

    async def to_trainer(self, timer: StepTimer | None) -> None: ...


def saves_due(c: CheckpointConfig, step: int, total_steps: int) -> tuple[bool, bool]:
    """(save a training checkpoint, export HF) after `step` of `total_steps`: every save_every /
    hf_export_every steps (0 = never) and, with save_at_end / hf_export_at_end, after the last.
    The RL loop (SaveSchedule) and the SFT / DPO jobs (mlrl.jobs.offline) both ask this."""
    last = step == total_steps
    save = bool(c.save_every and step % c.save_every == 0) or (last and c.save_at_end)
    export = bool(c.hf_export_every and step % c.hf_export_every == 0) or (last and c.hf_export_at_end)
    return save, export


class SaveSchedule:
    def __init__(self, cfg: CheckpointConfig, total_steps: int, checkpoint: Checkpointer,
                 colocation: Colocated | None = None):
        self.cfg = cfg
        self.total_steps = total_steps
        self.checkpoint = checkpoint
        self.colocation = colocation
        self.seconds = 0.0  # the last save / export's time, not yet reported
        # colocated: (step, loop state, save, export) due at a step, made in the next step's training phase
        self.deferred: tuple[int, Mapping[str, object], bool, bool] | None = None

    def due(self, step: int) -> tuple[bool, bool]:
        """(save a checkpoint, export HF) after `step` (saves_due)."""
        return saves_due(self.cfg, step, self.total_steps)

    async def after_step(self, step: int, loop_state: Callable[[], Mapping[str, object]]) -> None:
        """Commit a finished async save (a thread hop costs ~10 ms while the async producer runs,
        so only when one is pending), then save / export when due."""
        t0 = time.perf_counter()
        if self.checkpoint.pending is not None:
            await asyncio.to_thread(self.checkpoint.finalize, blocking=False)
        save, export = self.due(step)
        if self.colocation is not None and (save or export):
            if step != self.total_steps:
                self.deferred = (step, loop_state(), save, export)
                return
            await self.colocation.to_trainer(None)
        await self._write(step, loop_state() if save else None, export)
        self.seconds += time.perf_counter() - t0

    async def run_deferred(self, timer: StepTimer) -> None:
        """Colocated: the save / export the previous step deferred, with the trainer resident."""
        if self.deferred is None:
            return
        step, state, save, export = self.deferred
        self.deferred = None
        with timer("checkpoint"):
            await self._write(step, state if save else None, export)

    def take_seconds(self) -> float:
        """The time of the saves since the last call (the next step reports it as timing/checkpoint)."""
        s, self.seconds = self.seconds, 0.0
        return s

    async def _write(self, step: int, state: Mapping[str, object] | None, export: bool) -> None:
        if state is not None:
            await asyncio.to_thread(self.checkpoint.save, step, state)
        if export:
            await asyncio.to_thread(self.checkpoint.export_hf, step)

"""The loop's `Checkpointer` (mlrl.interfaces.Checkpointer): training checkpoints (trainer shards +
loop state, committed atomically by `CheckpointManager`) and Hugging Face exports.

The trainer writes its own shards (megatron-core dist-checkpointing, behind
`Policy.save_checkpoint`); this class decides where they go and when they become visible.

With checkpoint.async_save (GPU) the trainer ranks return from the save while megatron-core
still writes the shards in the background: such a save stays pending (its temporary folder,
step and loop state) and is committed (COMPLETE, rename, `latest`) only after megatron-core has
finalized it on every rank. `finalize` does that: the loop calls it every step without blocking
(a collective poll) and blocking at exit, and `save` calls it, blocking, before the next save
(at most one checkpoint is in flight). Without async_save, `save` commits at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlrl.checkpoint.manager import CheckpointManager
from mlrl.checkpoint.schedule import saves_due
from mlrl.ckpt_files.layout import ADAPTER_DIR, CRITIC_DIR, TRAINER_DIR
from mlrl.config import ConfigError
from mlrl.config.schema import CheckpointConfig
from mlrl.interfaces import PendingSave, Policy, ResumeInfo

log = logging.getLogger(__name__)


def check_resume_has_critic(resume: Path, uses_critic: bool) -> None:
    """A run that trains a critic can only resume from a checkpoint that holds one (a config
    error: reported before any process starts)."""
    if uses_critic and not (resume / CRITIC_DIR).is_dir():
        raise ConfigError(
            f"checkpoint.resume: {resume} holds no critic state (saved by a run without a critic) but this config "
            "trains a critic (algorithm.advantage=gae); resume from a checkpoint of a gae run or set "
            "checkpoint.resume=none"
        )


def report_resume(resume: Path, info: Mapping[str, Any] | None) -> None:
    """One line on what the trainer restored, and a warning for what it did not."""
    if not info:
        return
    log.info("resumed trainer state from %s: %d optimizer steps, saved layout %s", resume,
             int(info.get("optimizer_steps", 0)), info.get("saved_layout"))
    if not info.get("optimizer_loaded", True):
        log.warning("resume: the optimizer state was not loaded (%s): Adam's moments start from zero", resume)
    if not info.get("rng_restored", True):
        log.warning("resume: the random state was not restored (the parallel layout changed since the save): "
                    "dropout and other trainer randomness differ from an uninterrupted run")
    if info.get("scheduler_overrides"):
        log.warning("resume: the LR schedule follows the config, not the checkpoint, for %s",
                    ", ".join(f"{k}={v}" for k, v in dict(info["scheduler_overrides"]).items()))


class Checkpointer:
    """Saves (trainer shards + loop state, atomically) and exports HF folders for the loop."""

    def __init__(self, manager: CheckpointManager, run_dir: Path, policy: Policy, *, with_critic: bool = False,
                 async_save: bool = False):
        self.manager = manager
        self.run_dir = run_dir
        self.policy = policy
        self.with_critic = with_critic
        self.async_save = async_save
        self.last_saved: Path | None = None
        self.last_export: Path | None = None
        self.pending: PendingSave | None = None  # async save written, not yet committed

    def save(self, step: int, loop_state: Mapping[str, object]) -> Path | None:
        """The committed checkpoint, or None while an async save is still being written."""
        self.finalize()  # commit the previous async save first (a no-op without one)
        tmp = self.manager.begin(step)
        self.policy.save_checkpoint(tmp / TRAINER_DIR, critic_path=tmp / CRITIC_DIR if self.with_critic else None)
        if self.async_save and self.policy.finalize_checkpoints(blocking=False):
            self.pending = PendingSave(tmp, step, loop_state)  # shards still being written: never resumed from
            log.info("checkpoint step %d: shards are being written in the background", step)
            return None
        self.last_saved = self.manager.commit(tmp, step, loop_state)
        log.info("checkpoint saved: %s", self.last_saved)
        return self.last_saved

    def finalize(self, blocking: bool = True) -> Path | None:
        """Commit the pending async save once megatron-core has finalized it on every rank
        (`blocking`: wait for that). Returns the checkpoint committed now, else None. A collective
        on the trainer ranks when a save is pending; nothing at all otherwise."""
        if self.pending is None:
            return None
        left = self.policy.finalize_checkpoints(blocking=blocking)
        if left and blocking:
            raise RuntimeError(f"{left} checkpoint save(s) still pending after a blocking finalize")
        if left:
            return None
        pending, self.pending = self.pending, None
        self.last_saved = self.manager.commit(pending.tmp, pending.step, pending.loop_state)
        log.info("checkpoint saved: %s", self.last_saved)
        return self.last_saved

    def finish_pending(self, timeout_s: float = 10.0, poll_s: float = 0.5) -> Path | None:
        """At teardown (SIGTERM, a failed step): commit the pending async save once its shards are
        written, polling for at most `timeout_s` (Slurm's SIGKILL follows SIGTERM after KillWait,
        30 s by default, and the rest of the teardown needs its time too). A save not finished by
        then stays uncommitted: never resumed from, its temporary folder removed by the next run's
        save. Returns the checkpoint committed here, if
        any. Never raises (the teardown goes on)."""
        deadline, done = time.monotonic() + timeout_s, None
        try:
            while self.pending is not None:
                done = self.finalize(blocking=False)
                if done is not None or time.monotonic() >= deadline:
                    break
                time.sleep(poll_s)
        except Exception as err:  # the ranks may be what failed
            log.warning("the checkpoint being written in the background could not be committed: %s", err)
        if self.pending is not None:
            log.warning("checkpoint step %d was still being written at exit: not committed (resume takes the one "
                        "before)", self.pending.step)
        return done

    def load(self, resume: Path) -> ResumeInfo:
        """Load the trainer state (and the critic's) of a complete checkpoint into the ranks, and
        say what of it did not come back (the resumed run then differs from an uninterrupted one)."""
        info = self.policy.load_checkpoint(resume / TRAINER_DIR, resume / CRITIC_DIR if self.with_critic else None)
        report_resume(resume, info)
        return info

    def export_path(self, step: int) -> Path:
        return self.run_dir / "hf" / f"step_{step:06d}"

    def export_left_undone(self, cfg: CheckpointConfig, start_step: int, total_steps: int, *,
                           lora: bool = False) -> bool:
        """The HF export due at the resumed step is missing or incomplete: the previous run stopped
        during it (a step's checkpoint is committed before its export), e.g. preempted in the final
        export; the resumed run would otherwise finish without it. Complete: the model (config.json,
        renamed in last) unless a LoRA run exports its adapters only, and with LoRA the PEFT folder
        (written after the merged model, into it: the folder exists before it is whole)."""
        if not (start_step > 0 and saves_due(cfg, start_step, total_steps)[1]):
            return False
        out = self.export_path(start_step)
        model = (out / "config.json").is_file() or (lora and not cfg.export_merged)
        adapter = not lora or (out / ADAPTER_DIR / "adapter_config.json").is_file()
        return not (model and adapter)

    def export_hf(self, step: int) -> Path:
        out = self.export_path(step)
        self.policy.export_hf(out)
        self.last_export = out
        log.info("HF export written: %s", out)
        return out

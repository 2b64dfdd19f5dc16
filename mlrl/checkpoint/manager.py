"""Checkpoint directory layout, atomic commit, the `latest` pointer and keep-last-k.

Layout under the checkpoint root:

    step_000004/                 a complete checkpoint (only complete ones ever carry this name)
      model_optim/               Megatron dist_checkpointing (torch_dist): model, optimizer, scheduler, RNG
      trainer_state.json         step, weight version, data sampler position, metrics resume info
      COMPLETE                   written last inside the temporary folder, before the rename
    latest                       text file: name of the newest complete checkpoint
    .tmp-step_000006-<random>/   a save in progress (or killed mid-way): never loaded, removed later

Ordering kept (crash safety): write everything into `.tmp-*`, write COMPLETE, rename the folder
to `step_N` (atomic on one filesystem), then replace `latest` (write + os.replace), and only
then delete checkpoints beyond keep-last-k and stale temporary folders. A process killed at any
point leaves the previous checkpoint loadable, and a folder without COMPLETE is never picked.

The names and the read-only side (what is complete, which is latest) are mlrl.ckpt_files.layout's,
shared with the trainer ranks' model.init_from check; this module is the driver's writing side.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlrl.ckpt_files.atomic import write_json_atomic
from mlrl.ckpt_files.errors import CheckpointError
from mlrl.ckpt_files.layout import COMPLETE, STATE_FILE, STEP_RE, complete_checkpoints, is_complete, latest_checkpoint


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = keep_last

    def begin(self, step: int) -> Path:
        """A fresh temporary folder to save step `step` into."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{step_dir_name(step)}-{secrets.token_hex(4)}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int, state: Mapping[str, object]) -> Path:
        """Write the trainer state, mark complete, rename into place, move `latest`, prune."""
        write_json_atomic(tmp / STATE_FILE, {"step": step, **state})
        (tmp / COMPLETE).write_text("ok\n")
        _fsync_dir(tmp)
        final = self.root / step_dir_name(step)
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        tmp_latest = self.root / ".latest.tmp"
        tmp_latest.write_text(final.name + "\n")
        os.replace(tmp_latest, self.root / "latest")
        _fsync_dir(self.root)
        self._prune(keep=final)
        return final

    def _prune(self, keep: Path) -> None:
        """Stale temporary folders, and complete checkpoints beyond the newest keep_last; never
        `keep`, the one just committed (check_start keeps newer ones from sharing the root)."""
        for p in self.root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)
        if self.keep_last > 0:
            complete = self.complete_checkpoints()
            for p in complete[: -self.keep_last]:
                if p != keep:
                    shutil.rmtree(p, ignore_errors=True)

    def check_start(self, start_step: int) -> None:
        """A run that starts at `start_step` (0: fresh) must not share its root with complete
        checkpoints of later steps (another run's, or the timeline a rewind abandons): keep-last-k
        would delete each of the new run's saves in their favour, and `resume=auto` would later
        continue them. Refused before anything is written."""
        newer = [p.name for p in self.complete_checkpoints()
                 if (m := STEP_RE.match(p.name)) and int(m.group(1)) > start_step]
        if newer:
            start = f"step {start_step}" if start_step else "a fresh start"
            raise CheckpointError(
                f"checkpoint.dir {self.root} holds {', '.join(newer)}, newer than this run's start ({start}): its "
                "saves would be pruned in their favour and checkpoint.resume=auto would later continue them; resume "
                "the newest (checkpoint.resume=auto), use another logging.run_dir / checkpoint.dir, or move them away")

    def complete_checkpoints(self) -> list[Path]:
        return complete_checkpoints(self.root)

    def owns(self, ckpt: Path) -> bool:
        """`ckpt` is one of this root's checkpoints (this run's), not another run's."""
        return Path(ckpt).resolve().parent == Path(self.root).resolve()

    def latest(self) -> Path | None:
        """Newest complete checkpoint: the `latest` pointer if valid, else the newest complete folder."""
        return latest_checkpoint(self.root)

    def resolve_resume(self, spec: str) -> Path | None:
        """`auto` -> latest complete or None; `none` -> None; a path -> that checkpoint (validated)."""
        if spec == "none":
            return None
        if spec == "auto":
            return self.latest()
        path = Path(spec)
        if not path.exists():
            raise CheckpointError(f"checkpoint.resume: {spec!r} does not exist (expected auto, none or the path of a "
                                  "checkpoint or of a run's checkpoint folder)")
        # a run's checkpoint root: its `latest` pointer, or (killed before the first pointer write,
        # or copied by hand) its complete step folders decide
        if path.is_dir() and not STEP_RE.match(path.name) and ((path / "latest").is_file()
                                                                 or complete_checkpoints(path)):
            found = CheckpointManager(path).latest()
            if found is None:
                raise CheckpointError(f"checkpoint.resume: {spec!r} holds no complete checkpoint")
            return found
        if not is_complete(path):
            if not STEP_RE.match(path.name) and (path / "checkpoints").is_dir():  # a run folder, not its checkpoints
                raise CheckpointError(f"checkpoint.resume: {spec!r} is a run folder; name its checkpoints: "
                                      f"checkpoint.resume={path / 'checkpoints'} (or one step_N folder in it)")
            if not STEP_RE.match(path.name):
                raise CheckpointError(f"checkpoint.resume: {spec!r} is neither a checkpoint (step_N) nor a folder of "
                                      "checkpoints (expected auto, none, <run>/checkpoints or <run>/checkpoints/"
                                      "step_N)")
            raise CheckpointError(f"checkpoint.resume: {spec!r} is incomplete (no {COMPLETE} marker or {STATE_FILE}): "
                                  "a save was interrupted; pick an earlier checkpoint")
        return path


def read_state(ckpt: Path) -> dict[str, Any]:
    try:
        return json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: cannot read {STATE_FILE}: {e}") from None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

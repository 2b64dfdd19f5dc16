"""Metric sinks: JSONL (always complete lines, fsync'd per step) and TensorBoard, optional W&B
(`wandb_project`; the `wandb` extra: `pip install mlrl[wandb]`; W&B's own environment variables
apply, e.g. WANDB_MODE=offline, WANDB_RUN_ID to continue a run).

Invariant: a step's metrics are written as one JSON line and flushed before the step is
considered done, so a crash never leaves a half-written line that a resumed run would choke on.
A run starts from `resume_step` (the checkpoint's step, 0 for a fresh run): lines of later steps
(written by a run that died after that checkpoint, or by an earlier run in the same folder) are
dropped, so every curve stays single-valued; they are kept aside in `metrics.dropped.jsonl`
(appended) and the run says how many, so nothing written is lost.
"""

from __future__ import annotations

import json
import logging
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _scalar(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


def _clean(v: Any) -> Any:
    """For the JSON line: a non-finite float as its string ("nan", "inf"; JSON has no such numbers)."""
    v = _scalar(v)
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as e:
        raise ImportError(
            f"metrics: wandb_project is set but Weights & Biases is not installed ({e}); "
            "pip install mlrl[wandb]  (or pip install wandb), or unset wandb_project"
        ) from None
    return wandb


def _warn_wandb_rewind(run: Any, resume_step: int | None) -> None:
    """W&B only takes steps above the run's current one: continuing a W&B run (WANDB_RUN_ID) that
    logged past the checkpoint this run resumed from, it drops the re-run steps and keeps the
    abandoned run's values, which metrics.jsonl and TensorBoard have rewound. Said, not silent."""
    logged = int(getattr(run, "step", 0) or 0)  # the next step W&B accepts
    first = (resume_step or 0) + 1
    if logged > first:
        log.warning("W&B run %s already holds steps up to %d; W&B ignores steps below that, so steps %d-%d of this "
                    "resumed run will not reach it and it keeps the earlier run's values (metrics.jsonl and "
                    "TensorBoard have this run's). Unset WANDB_RUN_ID for a new W&B run to see them.",
                    getattr(run, "id", "?"), logged - 1, first, logged - 1)


class MetricsLogger:
    """Fan-out of scalar metrics per step to the configured sinks."""

    def __init__(self, run_dir: str | Path, *, jsonl: bool = True, tensorboard: bool = True,
                 wandb_project: str | None = None, resume_step: int | None = None, config: dict | None = None):
        wandb = _import_wandb() if wandb_project else None  # before any side effect: a clear error first
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl" if jsonl else None
        if self.jsonl_path is not None:
            self._trim_after(resume_step)
        self._rows: list[dict[str, Any]] = []  # this process's steps: the plot's source without metrics.jsonl
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                str(self.run_dir / "tensorboard"), purge_step=None if resume_step is None else resume_step + 1
            )
        self._wandb = None
        if wandb is not None:
            self._wandb = wandb.init(project=wandb_project, dir=str(self.run_dir), config=config, resume="allow",
                                     id=os.environ.get("WANDB_RUN_ID"))
            _warn_wandb_rewind(self._wandb, resume_step)

    def _trim_after(self, resume_step: int | None) -> None:
        """Drop lines of steps after `resume_step` and any torn last line (a crash mid-write)."""
        p = self.jsonl_path
        if p is None or not p.exists():
            return
        keep, dropped = [], []
        for line in p.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            (keep if resume_step is None or rec.get("step", 0) <= resume_step else dropped).append(line)
        if dropped:  # kept aside before the file is rewritten: the other timeline's lines are not lost
            aside = p.with_name("metrics.dropped.jsonl")
            with open(aside, "a") as f:
                f.write("".join(d + "\n" for d in dropped))
                f.flush()
                os.fsync(f.fileno())
            log.warning("metrics: %d line(s) of steps after %d (an earlier run in %s, or one that died after its "
                        "checkpoint) moved to %s", len(dropped), resume_step, self.run_dir, aside)
        tmp = p.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        os.replace(tmp, p)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        raw = {"step": step, **{k: _scalar(v) for k, v in metrics.items()}}
        rec = {k: _clean(v) for k, v in raw.items()}
        if self.jsonl_path is None:
            self._rows.append(rec)
        else:
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())
        # TensorBoard and W&B take the numbers themselves: a NaN loss must show there as NaN, not vanish
        # (as the JSON line's string it was no scalar)
        if self._tb is not None:
            self._tb_scalars(step, raw)
        if self._wandb is not None:
            self._wandb.log(raw, step=step)

    def _tb_scalars(self, step: int, rec: dict[str, Any]) -> None:
        """All of a step's scalars as ONE TensorBoard event (a Summary with one value per tag, the
        same `simple_value` records `add_scalar` writes one event each): the demo's metrics line
        is 88 scalars, one event and one flush instead of 88 events."""
        # protobuf-generated: the module builds its classes at import time, invisible to a type checker
        from tensorboard.compat.proto.summary_pb2 import Summary  # pyright: ignore[reportAttributeAccessIssue]

        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in rec.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)]
        if values:
            assert self._tb is not None  # log() calls this only with a writer
            # SummaryWriter's own file writer (it writes the purge_step marker of a resumed run first)
            self._tb._get_file_writer().add_summary(Summary(value=values), step)
            self._tb.flush()

    def close(self, *, plot: bool = False, wait: bool = True) -> Future[Path] | None:
        """Flush and close the sinks; `plot` (logging.plot): draw run.png from metrics.jsonl (the
        whole run, resumed parts included), or with logging.jsonl off from the steps this process
        logged. `wait=False` (a run's teardown): run.png is drawn in a thread of its own, and the
        future returned is done once it is written (raising what drawing raised); the caller stops
        its engines and trainer ranks meanwhile, which a run's end waited for after the drawing
        before (matplotlib's import and the figure: ~1.4 s of every run's end on 2 cores)."""
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if not plot:
            return None
        if self.jsonl_path is not None and self.jsonl_path.exists():
            records = read_jsonl(self.jsonl_path)
        else:
            records = self._rows
        if not records:
            return None
        from mlrl.metrics.plot import plot_run

        out = Path(self.run_dir) / "run.png"
        if wait:
            plot_run(records, out)
            return None
        drawing = ThreadPoolExecutor(1, thread_name_prefix="run-png")
        try:
            return drawing.submit(plot_run, records, out)
        finally:
            drawing.shutdown(wait=False)  # its one thread ends with the drawing


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out

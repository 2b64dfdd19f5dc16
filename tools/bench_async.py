"""Wall time per RL step: asynchronous (staleness eta = 1, 2) vs synchronous, same task, same machine.

    .venv/bin/python tools/bench_async.py [--config launch/cpu_default.yaml] [--steps 6] [a.b=c ...]

Runs `python -m mlrl.launch` three times (sync, async eta=1, async eta=2) one after the other and
compares the mean wall time per step, measured from the steps' start times in metrics.jsonl
(`timing/step`, the first step excluded: it includes warm-up). Prints a table of s/step and the
speed-up of each async mode, sync s/step / async s/step (> 1 means async is faster; #16's goal:
>= 1.5 at eta = 1), the last line being `ratio sync_vs_async_eta1: <x>`. Engine and trainer
start-up are not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(config: str, steps: int, run_dir: Path, extra: list[str]) -> list[float]:
    cmd = [sys.executable, "-m", "mlrl.launch", "--config", config, f"trainer.total_steps={steps}",
           f"logging.run_dir={run_dir}", "logging.progress_bar=false", "checkpoint.save_at_end=false",
           "checkpoint.hf_export_at_end=false", "logging.plot=false", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["timing/step"] for r in recs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="launch/cpu_default.yaml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from mlrl.config import load_config
    from mlrl.config.validate import validate

    validate(load_config(args.config, list(args.overrides)))  # bad input: one line, before any run
    modes = {
        "sync": ["rollout.staleness=0"],
        "async eta=1": ["rollout.staleness=1", "algorithm.rollout_is=tis"],
        "async eta=2": ["rollout.staleness=2", "algorithm.rollout_is=tis"],
    }
    per_step = {}
    with tempfile.TemporaryDirectory(prefix="mlrl-bench-async-") as tmp:
        for i, (name, ov) in enumerate(modes.items()):
            times = run(args.config, args.steps, Path(tmp) / f"run{i}", [*args.overrides, *ov])
            per_step[name] = statistics.mean(times[1:]) if len(times) > 1 else times[0]
    base = per_step["sync"]
    print(f"{'mode':<14}{'s/step':>10}{'sync/this':>12}")
    for name, t in per_step.items():
        print(f"{name:<14}{t:>10.3f}{base / t:>12.3f}")
    print(f"ratio sync_vs_async_eta1: {base / per_step['async eta=1']:.3f}")  # speed-up, measured in this run
    return 0


if __name__ == "__main__":
    import tool_errors

    sys.exit(tool_errors.run("bench_async", main))

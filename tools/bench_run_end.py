"""A run's end, from its teardown's start (the metrics sinks closing) to the launcher process's exit,
three ways: `sequential` (run.png drawn first, the engines and trainer ranks stopped after it, a
plain interpreter exit: the end before), `overlapped` (run.png drawn in a thread of its own while
they stop: `MetricsLogger.close(wait=False)`; plain exit) and `mlrl` (that, and the launcher's exit
without the interpreter's finalisation: `mlrl.procs.exit_without_finalising`, what
`python -m mlrl.launch` does).

    .venv/bin/python tools/bench_run_end.py [--repeats 2] [--recipes rl,sft]

Each sample is a fresh process running `mlrl.launch`'s main on a recipe for 2 steps: `rl` (the
default CPU GRPO demo: an engine and a trainer rank) or `sft` (launch/sft_cpu.yaml: a trainer rank).
The sample wraps MetricsLogger.close to note when the teardown starts and, for `sequential`, to
draw before returning; the end is the process's exit seen from here. The ways alternate, --repeats
times each per recipe. Last line: `ratio run_end_sequential_over_mlrl: x` (the medians summed over
the recipes; > 1: runs end sooner).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "rl": ["logging.progress_bar=false", "trainer.total_steps=2", "trainer.lr_warmup_steps=1"],
    "sft": ["--config", "launch/sft_cpu.yaml", "logging.progress_bar=false", "trainer.total_steps=2",
            "trainer.lr_warmup_steps=1"],
}

RUN = """
import json, sys, time
from mlrl.metrics import sinks
from mlrl.launch import main
from mlrl.procs import exit_without_finalising
way, run_dir, *args = sys.argv[1:]
marks = {}
real_close = sinks.MetricsLogger.close
def close(self, *, plot=False, wait=True):
    marks.setdefault("teardown", time.time())
    return real_close(self, plot=plot, wait=True if way == "sequential" else wait)
sinks.MetricsLogger.close = close
code = main([*args, "logging.run_dir=" + run_dir])
print(json.dumps({"code": code, "teardown": marks["teardown"]}), flush=True)
if way == "mlrl":
    exit_without_finalising(code)
sys.exit(code)
"""
WAYS = ("sequential", "overlapped", "mlrl")


def sample(way: str, recipe: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, err_path = Path(tmp) / "run", Path(tmp) / "stderr.txt"
        with err_path.open("w") as err_file:  # a file, not a pipe: an unread pipe would stall the run's logging
            proc = subprocess.Popen([sys.executable, "-c", RUN, way, str(run_dir), *RECIPES[recipe]], cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=err_file, text=True)
        assert proc.stdout is not None
        result = None
        for line in proc.stdout:
            if line.startswith('{"code"'):
                result = json.loads(line)
                break
        proc.wait(timeout=600)
        ended = time.time()
        err = err_path.read_text()
        if result is None or result["code"] != 0 or proc.returncode != 0:
            raise SystemExit(f"bench_run_end: the {way} {recipe} run failed (exit {proc.returncode}):\n{err[-3000:]}")
        if not (run_dir / "run.png").is_file():
            raise SystemExit(f"bench_run_end: the {way} {recipe} run drew no run.png")
    return ended - float(result["teardown"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--recipes", default="rl,sft", help=f"comma-separated, of {', '.join(RECIPES)}")
    args = ap.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or not recipes:
        print(f"bench_run_end: --recipes: unknown {','.join(unknown) or '(none given)'}; known: {', '.join(RECIPES)}",
              file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"bench_run_end: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    med: dict[str, float] = {way: 0.0 for way in WAYS}
    for recipe in recipes:
        times: dict[str, list[float]] = {way: [] for way in med}
        for _ in range(args.repeats):
            for way in times:
                times[way].append(sample(way, recipe))
        for way, ts in times.items():
            med[way] += statistics.median(ts)
            print(f"{recipe:>4} {way:>10}: run end {statistics.median(ts):.2f} s "
                  f"(median of {len(ts)}: {', '.join(f'{t:.2f}' for t in ts)})")
    print(f"ratio run_end_sequential_over_mlrl: {med['sequential'] / med['mlrl']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

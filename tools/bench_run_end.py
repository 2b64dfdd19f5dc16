"""A run's end, from its teardown's start (the metrics sinks closing) to `mlrl.launch`'s return:
run.png drawn first and the engines and trainer ranks stopped after it (`sequential`, the order
before) vs drawn in a thread of its own while they stop (`overlapped`, mlrl's teardown:
`MetricsLogger.close(wait=False)`).

    .venv/bin/python tools/bench_run_end.py [--repeats 2] [--recipes rl,sft]

Each sample is a fresh process running `mlrl.launch`'s main on a recipe for 2 steps: `rl` (the
default CPU GRPO demo: an engine and a trainer rank) or `sft` (launch/sft_cpu.yaml: a trainer rank).
The sample wraps MetricsLogger.close to note when the teardown starts and, for `sequential`, to
draw before returning. The two ways alternate, --repeats times each per recipe. Last line:
`ratio run_end_sequential_over_overlapped: x` (the medians summed over the recipes; > 1: runs end
sooner).
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
RECIPES = {
    "rl": ["logging.progress_bar=false", "trainer.total_steps=2", "trainer.lr_warmup_steps=1"],
    "sft": ["--config", "launch/sft_cpu.yaml", "logging.progress_bar=false", "trainer.total_steps=2",
            "trainer.lr_warmup_steps=1"],
}

RUN = """
import json, sys, time
from mlrl.metrics import sinks
from mlrl.launch import main
way, run_dir, *args = sys.argv[1:]
marks = {}
real_close = sinks.MetricsLogger.close
def close(self, *, plot=False, wait=True):
    marks.setdefault("teardown", time.perf_counter())
    return real_close(self, plot=plot, wait=wait if way == "overlapped" else True)
sinks.MetricsLogger.close = close
code = main([*args, "logging.run_dir=" + run_dir])
print(json.dumps({"code": code, "end_s": time.perf_counter() - marks["teardown"]}), flush=True)
"""


def sample(way: str, recipe: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-c", RUN, way, str(Path(tmp) / "run"), *RECIPES[recipe]], cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
        if not (Path(tmp) / "run" / "run.png").is_file():
            raise SystemExit(f"bench_run_end: the {way} {recipe} run drew no run.png (exit {out.returncode}):\n"
                             f"{out.stderr[-3000:]}")
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"code": out.returncode}
    if result["code"] != 0:
        raise SystemExit(f"bench_run_end: the {way} {recipe} run exited {result['code']}:\n{out.stderr[-3000:]}")
    return float(result["end_s"])


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
    med: dict[str, float] = {"sequential": 0.0, "overlapped": 0.0}
    for recipe in recipes:
        times: dict[str, list[float]] = {way: [] for way in med}
        for _ in range(args.repeats):
            for way in times:
                times[way].append(sample(way, recipe))
        for way, ts in times.items():
            med[way] += statistics.median(ts)
            print(f"{recipe:>4} {way:>10}: run end {statistics.median(ts):.2f} s "
                  f"(median of {len(ts)}: {', '.join(f'{t:.2f}' for t in ts)})")
    print(f"ratio run_end_sequential_over_overlapped: {med['sequential'] / med['overlapped']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

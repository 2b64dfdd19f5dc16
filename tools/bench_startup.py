"""An RL run's start-up (process start -> step 1 ready, `<run dir>/startup.json`) with the first
sync checked by the canary (`weight_sync.first_sync=auto`, mlrl's default: a fresh run's engines
loaded model.hf_dir themselves) vs pushed in full (`push`), alternating, on one or more recipes.

    python tools/bench_startup.py [--recipes launch/cpu_default.yaml,launch/smollm2_cpu.yaml] [--repeats 2]

Each run is `python -m mlrl.launch --config <recipe>` with one step of a small batch (the step's
own work does not enter start-up). Printed per recipe and mode: ready (median), the first sync's
share (first_sync_s - processes_s) and its bytes. Last line: `ratio first_sync_auto_vs_push_seconds:
x` (the first sync's seconds with auto / with push, each the sum over the recipes of the median
per recipe; < 1 = auto is faster), after the same ratio of ready (noisier: ready spreads by 1-2 s
from run to run on two cores, more than the demo's first sync takes either way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import tool_errors

REPO = Path(__file__).resolve().parents[1]
MODES = ("auto", "push")
SMALL_STEP = ("trainer.total_steps=1", "trainer.lr_warmup_steps=0", "trainer.prompts_per_step=2",
              "trainer.samples_per_prompt=2", "rollout.sampling.max_new_tokens=4",
              "checkpoint.save_at_end=false", "checkpoint.hf_export_at_end=false", "logging.progress_bar=false")


def launch_once(recipe: Path, mode: str, run_dir: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "mlrl.launch", "--config", str(recipe), *SMALL_STEP,
           f"weight_sync.first_sync={mode}", f"logging.run_dir={run_dir}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"bench_startup: {recipe.name} first_sync={mode} failed ({out.returncode}):\n"
                         f"{out.stderr[-3000:]}")
    return json.loads((run_dir / "startup.json").read_text())


def ready_of(ups: list[dict[str, float]]) -> list[float]:
    return [u["ready_s"] for u in ups]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", default="launch/cpu_default.yaml,launch/smollm2_cpu.yaml")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    recipes = tool_errors.recipe_paths(args.recipes, REPO)
    if args.repeats < 1:
        raise tool_errors.InputError(f"--repeats must be >= 1, got {args.repeats}")
    ready: dict[str, float] = dict.fromkeys(MODES, 0.0)  # sums over the recipes of the median per recipe
    sync: dict[str, float] = dict.fromkeys(MODES, 0.0)
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        for recipe in recipes:
            got: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
            for i in range(args.repeats):
                for mode in MODES:  # alternating: a slower moment of the machine hits both
                    up = launch_once(recipe, mode, Path(tmp) / f"{recipe.stem}-{mode}-{i}")
                    got[mode].append(up)
            for mode in MODES:
                ups = got[mode]
                runs = ", ".join(f"{u['ready_s']:.2f}" for u in ups)
                sync_s = statistics.median(u["first_sync_s"] - u["processes_s"] for u in ups)
                ready[mode] += statistics.median(ready_of(ups))
                sync[mode] += sync_s
                print(f"{recipe.name:22} first_sync={mode:5} ready {statistics.median(ready_of(ups)):6.2f} s"
                      f"  first sync {sync_s:5.2f} s  bytes {int(ups[0].get('first_sync_bytes', -1))}"
                      f"  (ready per run: {runs})")
    print(f"ready, summed over the recipes: auto {ready['auto']:.2f} s, push {ready['push']:.2f} s "
          f"(ratio {ready['auto'] / ready['push']:.3f}; the run-to-run spread of ready is ~1-2 s)")
    print(f"ratio first_sync_auto_vs_push_seconds: {sync['auto'] / sync['push']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(tool_errors.run("bench_startup", main))

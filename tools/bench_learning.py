"""Learning parity with TRL on a suite of task shapes: steps and wall time to a reward threshold.

    python tools/bench_learning.py [--quick] [--tasks a,b] [--seeds 1,2,3] [--json out.json] [--workdir DIR]

Needs trl, the `bench` extra (`.venv/bin/pip install --no-deps trl==1.16.0`, see bench_vs_trl.py).
Every task is one mlrl recipe plus overrides, run by mlrl (`python -m mlrl.launch`) and by TRL's GRPOTrainer through
tools/bench_vs_trl.py's two runners, which keep everything the same on both sides but the
generation backend and the trainer (see that file's docstring): model folder, rows and their
order, reward function, sampling, optimizer, loss, batch, seeds (trainer.seed; mlrl's per-request
vLLM seeds = rollout.sampling.seed = the same number). No task changes an mlrl default: the tiny
tasks take launch/cpu_default.yaml as it is and set only the task (dataset, reward, answer
budget, group size, prompts per step); the SmolLM2 task takes launch/smollm2_cpu.yaml the same way.

Per task and side, each seed runs until its reward reaches the task's threshold or the task's
step budget runs out (a run that reached it is stopped there). Reached = the mean reward over
the last `--window` steps (both sides alike; rewards of the samples the step trained on) is at
least the threshold. Printed per task: steps to the threshold (median over seeds, and each seed),
wall time to the threshold with start-up excluded (the sum of the step times up to that step),
start-up (process start -> beginning of step 1), and the mean step time. A seed that never reached
the threshold counts as more steps (and time) than any that did; a median that did not reach it
is printed as "> budget".

Last lines of each task: `ratio <task>_steps: x` and `ratio <task>_wall: y` (median mlrl / median
TRL; < 1 = mlrl needs fewer steps / less time). When TRL did not reach the threshold and mlrl did,
the ratio uses TRL's budget (an upper bound); when mlrl did not and TRL did, the ratio is inf.
The run closes with `ratio worst_steps: x` and `ratio worst_wall: y` (the largest over the tasks).

`--quick`: two tasks, one seed (under ten minutes on two cores), for routine use.
`--report runs.json`: print the tables again from a `--json` file, at the thresholds of this file's
task table (valid when a threshold is not above the one the runs used: a run stops once it reaches
its threshold, so its curve holds the first crossing of any lower one).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_vs_trl as vs
import tool_errors

REPO = Path(__file__).resolve().parents[1]
TINY = "launch/cpu_default.yaml"


@dataclass(frozen=True)
class Task:
    name: str
    shape: str                    # what the task exercises, for the report
    recipe: str                   # relative to the repository
    overrides: tuple[str, ...]    # the task itself: data, reward, answer budget, group size, batch
    threshold: float              # mean reward to reach
    budget: int                   # max steps per run
    quick: bool = False           # part of --quick


# the hyper-parameters of every tiny task: issue 29's (TRL's example settings), not the demo's lr 4e-3 /
# KL 1e-3, under which most of these tasks stall on both sides
TINY_HPARAMS = ("trainer.lr=1e-3", "algorithm.kl_coef=0.0")


def _tiny(data: str, reward: str, new_tokens: int, group: int, prompts: int) -> tuple[str, ...]:
    return (*TINY_HPARAMS, f"data.train=synthetic:{data}", f"workflow.reward={reward}",
            f"rollout.sampling.max_new_tokens={new_tokens}", f"trainer.samples_per_prompt={group}",
            f"trainer.prompts_per_step={prompts}")


TASKS: list[Task] = [
    Task("copy_digit", "1-token answer, group 16 (the CPU demo's task)", TINY,
         _tiny("copy_digit", "exact_match", 1, 16, 32), 0.9, 80, quick=True),
    Task("add_digits", "1-token answer, group 8", TINY,
         _tiny("add_digits", "exact_match", 1, 8, 64), 0.4, 150),
    Task("copy_pair", "2-token answer, partial credit, group 8", TINY,
         _tiny("copy_pair", "token_match", 2, 8, 64), 0.8, 120, quick=True),
    Task("reverse_digits", "4-token answer, partial credit, group 4", TINY,
         _tiny("reverse_digits", "token_match", 4, 4, 128), 0.5, 200),
    Task("reverse_var", "2-5 token answers ending in EOS, budget 8, partial credit, group 8", TINY,
         _tiny("reverse_var", "token_match", 8, 8, 64), 0.35, 200),
    Task("repeat_digit", "16-token answer, partial credit, group 16", TINY,
         _tiny("repeat_digit", "token_match", 16, 16, 32), 0.9, 150),
    Task("smollm2_arith", "SmolLM2-135M-Instruct, chat template, 48 new tokens, group 4", "launch/smollm2_cpu.yaml",
         ("trainer.samples_per_prompt=4", "trainer.prompts_per_step=8", "rollout.sampling.max_new_tokens=48"),
         0.25, 20),
]


def reached_at(rewards: list[float], threshold: float, window: int) -> int | None:
    """The first step (1-based) whose trailing mean over `window` steps (fewer at the start) is >= threshold."""
    for k in range(1, len(rewards) + 1):
        last = rewards[max(0, k - window):k]
        if sum(last) / len(last) >= threshold:
            return k
    return None


@dataclass
class SeedRun:
    seed: int
    steps: int | None          # steps to the threshold (None: not within the budget)
    wall_s: float | None       # wall time to the threshold, start-up excluded
    startup_s: float
    step_s: float              # mean step time (step 1 excluded when there are more)
    steps_run: int
    rewards: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    startup_breakdown: dict[str, float] = field(default_factory=dict)


def _run_side(side: str, task: Task, seed: int, args: argparse.Namespace, work: Path) -> SeedRun:
    ns = argparse.Namespace(
        model="tiny-llama", config=str(REPO / task.recipe), steps=task.budget, timeout=args.timeout,
        overrides=[*task.overrides, f"trainer.seed={seed}", f"rollout.sampling.seed={seed}"],
        trl_threads=args.trl_threads, trl_micro_batch=None)
    work.mkdir(parents=True, exist_ok=True)

    def done(rewards: list[float]) -> bool:
        return not args.full and reached_at(rewards, task.threshold, args.window) is not None

    run = (vs.run_mlrl if side == "mlrl" else vs.run_trl)(ns, task.budget, work, done=done, show_every=args.show_every)
    k = reached_at(run["rewards"], task.threshold, args.window)
    times = run["step_times"]
    rest = times[1:] or times
    return SeedRun(seed, k, None if k is None else sum(times[:k]), run["startup_s"], sum(rest) / len(rest),
                   len(times), [round(r, 4) for r in run["rewards"]], [round(t, 4) for t in times],
                   run.get("startup_breakdown", {}))


def _median(xs: list[float | None]) -> float | None:
    """Median with None (not reached) as +inf; None when the median itself is not reached."""
    m = statistics.median([math.inf if x is None else x for x in xs])
    return None if math.isinf(m) else m


def _ratio(m: float | None, t: float | None, t_bound: float) -> float:
    """median mlrl / median TRL; TRL not reached: its budget as the denominator (an upper bound);
    mlrl not reached: inf when TRL did, and when neither did, 1.0 (no difference measured)."""
    if m is None:
        return math.inf if t is not None else 1.0
    return m / (t if t is not None else t_bound)


def _cell(x: float | None, unit: str, budget_note: str) -> str:
    if x is None:
        return budget_note
    return f"{x:.0f}" if unit == "" else f"{x:.1f}{unit}"


def report_task(task: Task, runs: dict[str, list[SeedRun]]) -> dict[str, float]:
    print(f"\ntask {task.name}: {task.shape}; threshold {task.threshold}, budget {task.budget} steps")
    print(f"  {'':6}{'steps to thr':>14}{'(per seed)':>22}{'wall to thr':>13}{'start-up':>10}{'s/step':>9}")
    med: dict[str, dict[str, float | None]] = {}
    for side, rs in runs.items():
        med[side] = {
            "steps": _median([r.steps for r in rs]), "wall": _median([r.wall_s for r in rs]),
            "startup": statistics.median(r.startup_s for r in rs), "step_s": statistics.median(r.step_s for r in rs),
        }
        per_seed = ",".join("-" if r.steps is None else str(r.steps) for r in rs)
        m = med[side]
        print(f"  {side:6}{_cell(m['steps'], '', f'> {task.budget}'):>14}{per_seed:>22}"
              f"{_cell(m['wall'], ' s', '-'):>13}{m['startup']:>9.1f}s{m['step_s']:>8.2f}s")
    for side, rs in runs.items():
        # the seconds, in the order recorded
        keys = list(dict.fromkeys(k for r in rs for k in r.startup_breakdown if k.endswith("_s")))
        if keys:
            print(f"  {side} start-up (median s): " + ", ".join(
                f"{k.removesuffix('_s')} {statistics.median(r.startup_breakdown.get(k, 0.0) for r in rs):.1f}"
                for k in keys))
    out: dict[str, float] = {}
    if len(runs) == 2:
        m, t = med["mlrl"], med["trl"]
        trl_budget_wall = task.budget * (t["step_s"] or 0.0)
        out = {"steps": _ratio(m["steps"], t["steps"], task.budget),
               "wall": _ratio(m["wall"], t["wall"], trl_budget_wall)}
        print(f"ratio {task.name}_steps: {out['steps']:.3f}")
        print(f"ratio {task.name}_wall: {out['wall']:.3f}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the two quick tasks, one seed")
    ap.add_argument("--tasks", default=None, help=f"comma-separated subset of: {', '.join(t.name for t in TASKS)}")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds (default 1,2,3; --quick: 1)")
    ap.add_argument("--only", choices=("mlrl", "trl"), default=None, help="run one side only (no ratios)")
    ap.add_argument("--window", type=int, default=3, help="trailing steps averaged against the threshold")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every task's step budget")
    ap.add_argument("--trl-threads", type=int, default=None, help="torch threads of the TRL runs (default: cores)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per run before it is killed")
    ap.add_argument("--full", action="store_true", help="run every budget to its end (reward curves)")
    ap.add_argument("--show-every", type=int, default=25, help="print every N-th step of each run (0: none)")
    ap.add_argument("--json", default=None, help="write every run's measurements to this JSON file")
    ap.add_argument("--workdir", default=None, help="keep run folders and logs here (default: a temp dir)")
    ap.add_argument("--report", default=None, metavar="JSON", help="re-print the tables of a --json file")
    return ap.parse_args(argv)


def _rescore(task: Task, r: dict, window: int) -> SeedRun:
    """A stored run (`--json`) scored against this task's threshold."""
    k = reached_at(r["rewards"], task.threshold, window)
    times = r.get("step_times") or []
    wall = None if k is None else (sum(times[:k]) if times else None)
    return SeedRun(r["seed"], k, wall, r["startup_s"], r["step_s"], r["steps_run"], r["rewards"], times,
                   r.get("startup_breakdown", {}))


def report_json(path: str, window: int) -> int:
    data = json.loads(Path(path).read_text())
    by_name = {t.name: t for t in TASKS}
    ratios: dict[str, dict[str, float]] = {}
    for name, res in data["results"].items():
        task = by_name.get(name)
        if task is None:
            continue
        used = res.get("threshold", task.threshold)
        if task.threshold > used:
            raise SystemExit(f"{name}: threshold {task.threshold} is above the {used} the runs stopped at")
        ratios[name] = report_task(task, {s: [_rescore(task, r, window) for r in rs] for s, rs in res["runs"].items()})
    _close(ratios)
    return 0


def _close(ratios: dict[str, dict[str, float]]) -> None:
    ratios = {n: r for n, r in ratios.items() if r}
    if not ratios:
        return
    print("\n" + "".join(f"  {n:16} steps {r['steps']:7.3f}   wall {r['wall']:7.3f}\n" for n, r in ratios.items()))
    print(f"ratio worst_steps: {max(r['steps'] for r in ratios.values()):.3f}")
    print(f"ratio worst_wall: {max(r['wall'] for r in ratios.values()):.3f}")


def main(argv: list[str] | None = None) -> int:
    import os

    args = parse_args(argv)
    if args.report:
        return report_json(args.report, args.window)
    args.trl_threads = args.trl_threads or os.cpu_count() or 1
    by_name = {t.name: t for t in TASKS}
    if args.tasks:
        unknown = [n for n in args.tasks.split(",") if n not in by_name]
        if unknown:
            raise tool_errors.InputError(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
        tasks = [by_name[n] for n in args.tasks.split(",")]
    else:
        tasks = [t for t in TASKS if t.quick] if args.quick else list(TASKS)
    seeds = [int(s) for s in (args.seeds or ("1" if args.quick else "1,2,3")).split(",")]
    if args.budget_scale != 1.0:
        tasks = [Task(t.name, t.shape, t.recipe, t.overrides, t.threshold, max(1, round(t.budget * args.budget_scale)),
                      t.quick) for t in tasks]
    sides = [args.only] if args.only else ["mlrl", "trl"]
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_learning."))
    print(f"bench_learning: {len(tasks)} task(s) x {len(seeds)} seed(s) x {'/'.join(sides)}; work dir {work}",
          flush=True)
    t0 = time.time()
    results: dict[str, Any] = {}
    ratios: dict[str, dict[str, float]] = {}
    for task in tasks:
        runs: dict[str, list[SeedRun]] = {s: [] for s in sides}
        for seed in seeds:
            for side in sides:
                print(f"[{task.name}] {side} seed {seed}", flush=True)
                runs[side].append(_run_side(side, task, seed, args, work / task.name / f"{side}_{seed}"))
        ratios[task.name] = report_task(task, runs)
        results[task.name] = {"threshold": task.threshold, "budget": task.budget,
                              "runs": {s: [vars(r) for r in rs] for s, rs in runs.items()}}
        if args.json:
            Path(args.json).write_text(json.dumps({"results": results, "ratios": ratios}, indent=1, default=str))
    print(f"\nbench_learning: {time.time() - t0:.0f} s in all")
    _close(ratios)
    return 0


if __name__ == "__main__":
    sys.exit(tool_errors.run("bench_learning", main))

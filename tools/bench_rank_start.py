"""CPU seconds of whole one-step CPU launches with one of mlrl's start-up savings on (its default)
and off, alternating; `--switch` picks which:
- `eager_fuser` (default): megatron-core imported the CPU way (no `torch.compile` and no wandb
  while megatron.core first imports, see mlrl/trainer/rank/cpu_compat.py mechanisms 7 and 8) vs
  megatron's own import (`MLRL_CPU_EAGER_FUSER=0` in the launch's environment, which its ranks
  inherit);
- `import_cache`: transformers' import with its two scans read from mlrl's cache
  (mlrl/import_cache.py) vs computed (`MLRL_IMPORT_CACHE=0`); every process of a launch imports
  transformers. Also measured first: `import mlrl, transformers` plus one model's module, in a
  fresh interpreter, 5 times each way. The cache is filled by one untimed launch per recipe first.

    python tools/bench_rank_start.py [--switch eager_fuser|import_cache]
                                     [--recipes launch/sft_cpu.yaml,launch/cpu_default.yaml] [--tp 1,2]
                                     [--repeats 2]

Each run is `python -m mlrl.launch --config <recipe> parallel.tp=<tp>` for one small step, no
checkpoint or export. Measured: the CPU seconds (user + system) of the launch's whole process tree
(launcher, torchrun, trainer ranks, vLLM engines where the recipe has them; the children's
rusage once the launch has exited), the wall seconds, and the trainer's start-up span
(`span/trainer_s` of startup.json, RL recipes only). Printed: medians per recipe, layout and mode.
Last line `ratio eager_fuser_vs_compiled_launch_cpu: x` (`ratio import_cache_vs_uncached_launch_cpu: x`):
the launches' CPU seconds with mlrl's default over those with the saving off, each summed over the
cases' medians (< 1 = fewer).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tool_errors

REPO = Path(__file__).resolve().parents[1]
# --switch: (environment variable, {mode: value}, ratio name); the first mode is mlrl's default
SWITCHES = {
    "eager_fuser": ("MLRL_CPU_EAGER_FUSER", {"eager": "1", "compiled": "0"}, "eager_fuser_vs_compiled_launch_cpu"),
    "import_cache": ("MLRL_IMPORT_CACHE", {"cached": "1", "uncached": "0"}, "import_cache_vs_uncached_launch_cpu"),
}
IMPORT_PROBE = "import mlrl, transformers, transformers.models.llama"
ONE_STEP = ("trainer.total_steps=1", "trainer.lr_warmup_steps=0", "checkpoint.save_at_end=false",
            "checkpoint.hf_export_at_end=false", "logging.progress_bar=false", "logging.plot=false")
RL_SMALL = ("trainer.prompts_per_step=2", "trainer.samples_per_prompt=2")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def import_once(env: dict[str, str]) -> float:
    cpu0 = _children_cpu()
    subprocess.run([sys.executable, "-c", IMPORT_PROBE], cwd=REPO, check=True, timeout=300, env=env)
    return _children_cpu() - cpu0


def launch_once(recipe: Path, tp: int, env: dict[str, str], run_dir: Path) -> dict[str, float]:
    rl = "sft" not in recipe.stem and "dpo" not in recipe.stem and "rm" not in recipe.stem
    cmd = [sys.executable, "-m", "mlrl.launch", "--config", str(recipe), *ONE_STEP, *(RL_SMALL if rl else ()),
           f"parallel.tp={tp}", f"logging.run_dir={run_dir}"]
    cpu0, t0 = _children_cpu(), time.monotonic()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    if out.returncode != 0:
        raise SystemExit(f"bench_rank_start: {recipe.name} tp={tp} failed ({out.returncode}):\n"
                         f"{out.stderr[-3000:]}")
    up = run_dir / "startup.json"
    trainer = json.loads(up.read_text()).get("span/trainer_s", float("nan")) if up.exists() else float("nan")
    return {"cpu": cpu, "wall": wall, "trainer": trainer}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="eager_fuser")
    ap.add_argument("--recipes", default="launch/sft_cpu.yaml,launch/cpu_default.yaml")
    ap.add_argument("--tp", default="1,2", help="trainer layouts (parallel.tp), comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    recipes = tool_errors.recipe_paths(args.recipes, REPO)
    try:
        tps = [int(t) for t in args.tp.split(",") if t]
    except ValueError:
        raise tool_errors.InputError(f"--tp must be comma-separated integers, got {args.tp!r}") from None
    if not tps or min(tps) < 1:
        raise tool_errors.InputError(f"--tp must list layouts >= 1, got {args.tp!r}")
    if args.repeats < 1:
        raise tool_errors.InputError(f"--repeats must be >= 1, got {args.repeats}")
    var, modes, ratio = SWITCHES[args.switch]
    envs = {mode: dict(os.environ, **{var: value}) for mode, value in modes.items()}
    default, other = modes
    total = dict.fromkeys(modes, 0.0)
    with tempfile.TemporaryDirectory(prefix="bench_rank_start_") as tmp:
        if args.switch == "import_cache":
            imports: dict[str, list[float]] = {m: [] for m in modes}
            import_once(envs[default])  # fills the cache
            for _ in range(5):
                for mode in modes:
                    imports[mode].append(import_once(envs[mode]))
            print(f"`{IMPORT_PROBE}`: " + ", ".join(
                f"{mode} {statistics.median(v):.2f} CPU s (runs: {', '.join(format(x, '.2f') for x in v)})"
                for mode, v in imports.items()), flush=True)
        for recipe in recipes:
            if args.switch == "import_cache":  # every process kind of this recipe fills the cache
                launch_once(recipe, tps[0], envs[default], Path(tmp) / f"{recipe.stem}-warm")
            for tp in tps:
                got: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
                for i in range(args.repeats):
                    for mode in modes:  # alternating: a slower moment of the machine hits both
                        got[mode].append(launch_once(recipe, tp, envs[mode],
                                                     Path(tmp) / f"{recipe.stem}-tp{tp}-{mode}-{i}"))
                for mode in modes:
                    runs = got[mode]
                    cpu = statistics.median(r["cpu"] for r in runs)
                    total[mode] += cpu
                    print(f"{recipe.name:18} tp={tp} {mode:8}  CPU {cpu:6.1f} s  wall "
                          f"{statistics.median(r['wall'] for r in runs):5.1f} s  trainer start-up "
                          f"{statistics.median(r['trainer'] for r in runs):5.1f} s  "
                          f"(CPU per run: {', '.join(format(r['cpu'], '.1f') for r in runs)})", flush=True)
    print(f"CPU seconds summed over the cases: {default} {total[default]:.1f}, {other} {total[other]:.1f}")
    print(f"ratio {ratio}: {total[default] / total[other]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(tool_errors.run("bench_rank_start", main))

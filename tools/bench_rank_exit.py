"""How long a trainer rank takes to end once its service loop returned: `mlrl.trainer.rank.service._exit`
(exit handlers, then no interpreter finalisation) vs a plain `sys.exit` (finalisation included).

    .venv/bin/python tools/bench_rank_exit.py [--repeats 3]

Each sample is a fresh process holding what a CPU rank holds at the end of a run: the rank's
imports (torch, megatron-core, transformers, triton through them), a gloo process group (destroyed
first, as the service does), and a model's tensors. It prints a timestamp when it is done and then
exits one way or the other; the sample is the wall time from that timestamp to the process's end,
seen from here. The two ways alternate, --repeats times each. Last line: `ratio rank_exit_plain_over_fast: x`
(> 1: the fast exit ends the rank sooner; every run's teardown waits for its ranks).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mlrl.procs import free_port

ROOT = Path(__file__).resolve().parents[1]

RANK = """
import os, sys, time
import torch, torch.distributed as dist
import mlrl.trainer.rank.policy  # noqa: F401  (the rank's imports: megatron-core, transformers)
from mlrl.trainer.rank.service import _exit
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
model(torch.randn(4, 256)).sum().backward()
dist.destroy_process_group()
print(time.time(), flush=True)
if sys.argv[1] == "fast":
    _exit(0)
sys.exit(0)
"""


def sample(way: str) -> float:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, "-c", RANK, way, str(free_port())], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    done = float(proc.stdout.readline())
    if proc.wait(timeout=120) != 0:
        raise SystemExit(f"bench_rank_exit: the {way} rank exited {proc.returncode}")
    return time.time() - done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.repeats < 1:
        print(f"bench_rank_exit: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    times: dict[str, list[float]] = {"plain": [], "fast": []}
    for _ in range(args.repeats):
        for way in times:
            times[way].append(sample(way))
    med = {way: statistics.median(ts) for way, ts in times.items()}
    for way, ts in times.items():
        print(f"{way:>5}: exit {med[way]:.2f} s (median of {len(ts)}: {', '.join(f'{t:.2f}' for t in ts)})")
    print(f"ratio rank_exit_plain_over_fast: {med['plain'] / med['fast']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

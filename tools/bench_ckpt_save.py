"""A trainer rank's synchronous checkpoint saves: megatron-core's torch_dist writer with its own
results queue (a spawn-context multiprocessing Manager, started at the process's first save) vs
the in-process queue mlrl's save uses (`mlrl.trainer.rank.dist_ckpt._in_process_results_queue`).

    .venv/bin/python tools/bench_ckpt_save.py [--repeats 3] [--mb 8]

Each sample is a fresh process holding what a CPU rank holds when it first saves: the rank's
imports (torch, megatron-core, transformers), a one-rank gloo group, the CPU compat layer, and a
sharded state dict of --mb MB of float32 tensors (16 of them). It times its first save (the one
that starts megatron's Manager) and a second save (Manager already up) into fresh folders. The two
ways alternate, --repeats times each. Last line: `ratio first_save_megatron_over_in_process: x`
(> 1: the in-process queue makes a rank's first save faster; every run's first save is one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RANK = """
import json, sys, tempfile, time
from pathlib import Path
import torch, torch.distributed as dist
import mlrl.trainer.rank.policy  # noqa: F401  (the rank's imports: megatron-core, transformers)
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from mlrl.procs import free_port
from mlrl.trainer.rank import cpu_compat, dist_ckpt
import contextlib
way, mb = sys.argv[1], float(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
if cpu_compat.needed():
    cpu_compat.apply()
n = max(1, int(mb * 2**20 / 4 / 16))
tensors = {f"w{i}": torch.randn(n) for i in range(16)}
strategy = dist_checkpointing.serialization.get_default_save_sharded_strategy("torch_dist")
out = {}
with tempfile.TemporaryDirectory() as tmp:
    for which in ("first", "second"):
        path = Path(tmp) / which
        path.mkdir()
        sd = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}
        t0 = time.perf_counter()
        with dist_ckpt._in_process_results_queue() if way == "in_process" else contextlib.nullcontext():
            dist_checkpointing.save(sd, str(path), sharded_strategy=strategy)
        out[which] = time.perf_counter() - t0
dist.destroy_process_group()
print(json.dumps(out), flush=True)
"""


def sample(way: str, mb: float) -> dict[str, float]:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", RANK, way, str(mb)], cwd=ROOT, capture_output=True, text=True,
                         env=env, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"bench_ckpt_save: the {way} rank exited {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mb", type=float, default=8.0, help="the state dict's size in MB (default 8)")
    args = ap.parse_args()
    if args.repeats < 1:
        print(f"bench_ckpt_save: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    if not args.mb > 0:
        print(f"bench_ckpt_save: --mb must be > 0, got {args.mb}", file=sys.stderr)
        return 2
    times: dict[str, list[dict[str, float]]] = {"megatron": [], "in_process": []}
    for _ in range(args.repeats):
        for way in times:
            times[way].append(sample(way, args.mb))
    med = {way: {k: statistics.median(s[k] for s in samples) for k in ("first", "second")}
           for way, samples in times.items()}
    for way, samples in times.items():
        firsts = ", ".join(f"{s['first']:.2f}" for s in samples)
        print(f"{way:>10}: first save {med[way]['first']:.2f} s ({firsts}), second {med[way]['second']:.2f} s "
              f"(median of {len(samples)}, {args.mb:g} MB)")
    print(f"ratio first_save_megatron_over_in_process: {med['megatron']['first'] / med['in_process']['first']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m mlrl.launch`: the single entry point.

    python -m mlrl.launch                                  # the CPU default recipe (launch/cpu_default.yaml)
    python -m mlrl.launch --config launch/X.yaml a.b=c     # a recipe with overrides
    python -m mlrl.launch ... --print-config               # print the resolved config and exit
    python -m mlrl.launch ... --dry-run [--nodes N]        # plan placement and memory, start nothing
    python -m mlrl.launch --nodes 16 --config ...          # on a Ray cluster (cluster.ray_address, default "auto")

Order kept: parse -> load -> validate (all before any process starts) -> plan -> the job
(mlrl.jobs: rl, sft or dpo, chosen by the config).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlrl.config import ConfigError, dump_yaml, load_config, validate
from mlrl.config.validate import check_driver

DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "launch" / "cpu_default.yaml"


def local_gpu_gib() -> float | None:
    """The smallest GPU memory of this machine in GiB, read through NVML (no CUDA context in the
    launcher, whose GPUs the ranks and engines are about to take); None without NVML or GPUs."""
    try:
        import pynvml  # pyright: ignore[reportMissingImports]  (nvidia-ml-py: the GPU environment has it)

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        sizes = [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total for i in range(count)]
        return min(sizes) / 2**30 if sizes else None
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m mlrl.launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", help="YAML recipe (default: launch/cpu_default.yaml)")
    ap.add_argument("--nodes", type=int, help="run on a Ray cluster of N nodes (sets cluster.nodes)")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    ap.add_argument("--dry-run", action="store_true", help="print placement, layout and memory estimate; start nothing")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5")
    return ap.parse_intermixed_args(argv)  # overrides may stand on both sides of an option


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.nodes is not None:
        overrides.append(f"cluster.nodes={args.nodes}")
    try:
        cfg = load_config(args.config or DEFAULT_RECIPE, overrides)
        layout = validate(cfg, dry_run=args.dry_run or args.print_config)
        if not (args.dry_run or args.print_config):
            check_driver(cfg)
        if cfg.trainer.micro_batch_tokens == "auto":  # sized by the memory plan (the planner is imported only here)
            from mlrl.plan.planner import resolve_micro_batch_tokens

            here = cfg.cluster.nodes == 1 and cfg.cluster.gpus_per_node > 0 and not (args.dry_run or args.print_config)
            resolve_micro_batch_tokens(cfg, layout, local_gpu_gib() if here else None)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    if args.dry_run and cfg.evaluate is not None:  # engines only: their placement and memory (mlrl.plan.evaluation)
        from mlrl.plan.evaluation import evaluation_plan

        try:
            ev = evaluation_plan(cfg)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        print(ev.text())
        for why in ev.reasons:
            print(f"dry-run: does not fit: {why}", file=sys.stderr)
        return 0 if ev.fits else 3
    if args.dry_run:
        from mlrl.plan import format_plan, make_plan

        try:
            plan = make_plan(cfg, layout)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        print(format_plan(plan))
        for why in plan.reasons:
            print(f"dry-run: does not fit: {why}", file=sys.stderr)
        return 0 if plan.fits else 3
    from mlrl.ckpt_files.errors import CheckpointError
    from mlrl.cluster import ClusterError
    from mlrl.data.rows import DatasetError
    from mlrl.jobs import job_for

    try:  # RL, SFT or DPO (mlrl.jobs): siblings, only the chosen one is imported
        return job_for(cfg)(cfg, layout)
    except ConfigError as e:  # found by the runner's cheap checks (data, devices), before any process starts
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except DatasetError as e:  # a data file that cannot be read or a malformed row (names the file and line)
        print(f"data error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # checkpoint.resume / model.init_from names no usable checkpoint (names it)
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 2
    except ClusterError as e:  # --nodes: the Ray cluster cannot host the plan (nothing was started)
        print(f"cluster error: {e}", file=sys.stderr)
        return 4


if __name__ == "__main__":
    # the interpreter's finalisation (torch's, transformers' native teardown) is skipped: it took
    # 1.5-1.7 s of an SFT run's end; threads, exit handlers and buffered output end as usual
    from mlrl.procs import exit_without_finalising

    exit_without_finalising(main())

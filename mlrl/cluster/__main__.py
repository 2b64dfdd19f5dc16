"""`python -m mlrl.cluster wait --address HOST:PORT --nodes N --gpus-per-node G [--timeout S]`

Blocks until the Ray cluster has N alive nodes with >= G GPUs each (exit 0), or fails after the
timeout with a one-line reason naming what registered (exit 1). slurm/train_grpo.sh runs it on
the head node between starting the Ray workers and starting the launcher.
"""

from __future__ import annotations

import argparse
import sys

from mlrl.cluster.assignment import ClusterError
from mlrl.cluster.ray_cluster import connect, wait_for_nodes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlrl.cluster")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait", help="wait until N GPU nodes have joined the Ray cluster")
    w.add_argument("--address", default="auto")
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--gpus-per-node", type=int, required=True)
    w.add_argument("--timeout", type=float, default=600.0, help="seconds")
    args = ap.parse_args(argv)
    try:
        connect(args.address)
        nodes = wait_for_nodes(args.nodes, args.gpus_per_node, timeout_s=args.timeout)
    except ClusterError as e:
        print(f"mlrl.cluster: {e}", file=sys.stderr)
        return 1
    print(f"mlrl.cluster: {len(nodes)} node(s) with >= {args.gpus_per_node} GPUs: "
          + ", ".join(n["NodeManagerAddress"] for n in nodes))
    return 0


if __name__ == "__main__":
    sys.exit(main())

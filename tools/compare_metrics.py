"""Two runs' metrics.jsonl, step by step: every value must be equal except timings.

    python tools/compare_metrics.py RUN_A/metrics.jsonl RUN_B/metrics.jsonl

For refactors whose rule is "identical losses, rewards and checkpoints": run the same recipe and
seeds before and after, then compare. Timing keys (timing/*, *_s, */seconds, */bytes_per_s,
episodes/time_*) are left out; everything else (losses, rewards, advantages, KL, grad norms,
packing, weight-sync canaries) must match exactly (NaN equals NaN). Prints the differing keys
and exits 1 when any differ or the steps do not line up (2 when a file is not a metrics.jsonl);
the last line is `ratio equal_values: <equal / compared>`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

TIMING = re.compile(r"^timing/|_s$|/seconds$|/bytes_per_s$|^episodes/time_")


class BadInput(ValueError):
    """A file that is not a run's metrics.jsonl: exit 2 (1 means the runs differ)."""


def read(path: Path) -> dict[int, dict[str, float]]:
    rows = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}: not UTF-8 text (byte at offset {e.start})") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if n == len(lines):  # a torn last line (a run that crashed mid-write): as mlrl's reader, left out
                    continue
                raise BadInput(f"{path}:{n}: not JSON ({e})") from None
            step = row.get("step") if isinstance(row, dict) else None
            if not isinstance(step, int) or isinstance(step, bool):
                raise BadInput(f"{path}:{n}: not a metrics line (expected an object with an integer 'step')")
            rows[step] = row
    return rows


def same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]]) -> tuple[int, int, list[str]]:
    """(values compared, values equal, problems)."""
    problems, compared, equal = [], 0, 0
    if sorted(a) != sorted(b):
        problems.append(f"steps differ: {sorted(a)} vs {sorted(b)}")
    for step in sorted(set(a) & set(b)):
        ka = {k for k in a[step] if not TIMING.search(k)}
        kb = {k for k in b[step] if not TIMING.search(k)}
        if ka != kb:
            problems.append(f"step {step}: keys only in A {sorted(ka - kb)}, only in B {sorted(kb - ka)}")
        for k in sorted(ka & kb):
            compared += 1
            if same(a[step][k], b[step][k]):
                equal += 1
            else:
                problems.append(f"step {step}: {k}: {a[step][k]!r} != {b[step][k]!r}")
    return compared, equal, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    for p in (args.a, args.b):
        if not p.is_file():
            print(f"compare_metrics: {p}: no such file (expected a run's metrics.jsonl)", file=sys.stderr)
            return 2
    try:
        a, b = read(args.a), read(args.b)
    except BadInput as e:
        print(f"compare_metrics: {e}", file=sys.stderr)
        return 2
    compared, equal, problems = compare(a, b)
    for p in problems:
        print(p)
    print(f"{len(a)} steps, {compared} values compared (timings left out), {equal} equal")
    print(f"ratio equal_values: {equal / compared if compared else 0.0:.6f}")
    return 0 if not problems and compared else 1


if __name__ == "__main__":
    sys.exit(main())

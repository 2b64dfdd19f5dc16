"""`python -m mlrl.launch` as the end-to-end tests run it: a subprocess in the repository root
that must exit 0 (its output tails in the failure message), and the run's metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def launch(run_dir: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mlrl.launch", *args, f"logging.run_dir={run_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    assert out.returncode == 0, f"launch failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

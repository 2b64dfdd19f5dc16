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


def launch_refused(*args: str) -> subprocess.CompletedProcess:
    """`mlrl.launch` run in this process, for the checks that must refuse a run before anything
    works: the same `main` as `python -m mlrl.launch` (that module only adds `sys.exit`), without a
    fresh interpreter's ~5 s of imports per call. Starting any process meanwhile (subprocess, a
    multiprocessing child, torchrun, Ray) fails the call at once with AssertionError, so a check that
    stopped refusing cannot start a run inside the test process. One start is expected and skipped:
    an RL run's gated engines (`EnginePool.prestart`, which begins their vLLM import while
    the checks run; that their servers start gated and stop unstarted is tested in
    tests/unit/rollout/test_engine_server.py and tests/integration/rollout/test_engine_gate.py).
    Returns the exit code and what was printed, as `launch` would."""
    import _posixsubprocess
    import contextlib
    import io
    from unittest import mock

    from mlrl.launch import main
    from mlrl.rollout.pool import EnginePool

    def started(*a, **k):
        raise AssertionError(f"mlrl.launch {' '.join(args)}: started a process before refusing")

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    guards = [mock.patch.object(_posixsubprocess, "fork_exec", started),  # multiprocessing's spawn
              mock.patch.object(subprocess, "_fork_exec", started),       # subprocess's own reference to it
              mock.patch.object(os, "posix_spawn", started), mock.patch.object(os, "fork", started),
              mock.patch.object(EnginePool, "prestart", lambda pool: None)]
    with contextlib.ExitStack() as stack:
        for guard in guards:
            stack.enter_context(guard)
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        os.chdir(ROOT)
        try:
            code = main(list(args))
        finally:
            os.chdir(here)
    return subprocess.CompletedProcess(["mlrl.launch", *args], code, out.getvalue(), err.getvalue())

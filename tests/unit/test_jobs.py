"""`python -m mlrl.launch` dispatches to the job the config describes (mlrl.jobs: rl, sft, dpo),
siblings: a trainer-only job imports neither the RL job, its loop nor the engine pool."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlrl.config import load_config
from mlrl.jobs import JOBS, job_name

ROOT = Path(__file__).resolve().parents[2]
RL_TRUNK = ("mlrl.jobs.rl", "mlrl.loop", "mlrl.loop_async", "mlrl.rollout.pool", "mlrl.update")


@pytest.mark.parametrize("recipe,job", [("cpu_default.yaml", "rl"), ("sft_cpu.yaml", "sft"), ("dpo_cpu.yaml", "dpo")])
def test_the_config_picks_the_job_and_only_its_modules_are_imported(recipe, job):
    assert job_name(load_config(ROOT / "launch" / recipe, [])) == job and job in JOBS
    code = (
        "import json, sys\n"
        "from mlrl.config import load_config\n"
        "from mlrl.jobs import job_for\n"
        f"run = job_for(load_config({str(ROOT / 'launch' / recipe)!r}, []))\n"
        "print(json.dumps([run.__module__, sorted(m for m in sys.modules if m.startswith('mlrl.'))]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    module, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert module == f"mlrl.jobs.{job}"
    others = {f"mlrl.jobs.{j}" for j in JOBS} - {module}
    assert not others & set(loaded), f"{recipe}: the other jobs were imported too: {sorted(others & set(loaded))}"
    if job == "rl":
        assert set(RL_TRUNK) <= set(loaded)  # the check below can fail: these are what the RL job imports
    else:
        trunk = sorted(set(RL_TRUNK) & set(loaded))
        assert not trunk, f"{recipe}: the RL trunk was imported: {trunk}"

"""`python -m mlrl.launch` dispatches to the job the config describes (mlrl.jobs: rl, sft, dpo,
evaluate), siblings: a trainer-only job imports neither the RL job, its loop nor the engine pool;
an evaluation imports the engine pool but not the RL job or its loop."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlrl.config import load_config
from mlrl.jobs import ENTRY, JOBS, job_name

ROOT = Path(__file__).resolve().parents[2]
BODY = {"evaluate": "evaluate_run"}  # a job's body, when its entry module imports it late
RL_TRUNK = ("mlrl.jobs.rl", "mlrl.loop", "mlrl.loop_async", "mlrl.rollout.pool", "mlrl.update")


def _modules_after(code: str) -> list[list[str]]:
    """Run `code` in a fresh interpreter; it prints JSON lines, returned parsed."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return [json.loads(line) for line in out.stdout.strip().splitlines() if line.startswith("[")]


@pytest.mark.parametrize("recipe,job", [("cpu_default.yaml", "rl"), ("sft_cpu.yaml", "sft"), ("dpo_cpu.yaml", "dpo"),
                                        ("eval_cpu.yaml", "evaluate")])
def test_the_config_picks_the_job_and_only_its_modules_are_imported(recipe, job):
    assert job_name(load_config(ROOT / "launch" / recipe, [])) == job and job in JOBS
    code = (
        "import json, sys\n"
        "from mlrl.config import load_config\n"
        "from mlrl.jobs import job_for\n"
        f"run = job_for(load_config({str(ROOT / 'launch' / recipe)!r}, []))\n"
        "print(json.dumps([run.__module__, sorted(m for m in sys.modules if m.startswith(('mlrl.', 'torch')))]))\n"
        f"import mlrl.jobs.{BODY.get(job, job)}\n"
        "print(json.dumps(['', sorted(m for m in sys.modules if m.startswith('mlrl.'))]))\n"
    )
    (module, loaded), (_, job_loaded) = _modules_after(code)
    assert module == f"mlrl.jobs.{ENTRY.get(job, job)}"
    others = {f"mlrl.jobs.{j}" for j in JOBS} - {f"mlrl.jobs.{job}"}
    assert not others & set(job_loaded), f"{recipe}: other jobs imported too: {sorted(others & set(job_loaded))}"
    if job == "rl":
        # the entry (rl_start) starts the engines before the job's trunk, torch included, is imported
        early = sorted((set(RL_TRUNK) - {"mlrl.rollout.pool"} | {"torch"}) & set(loaded))
        assert not early, f"the RL job's entry imported {early} before starting its engines"
        assert set(RL_TRUNK) <= set(job_loaded)  # the check above can fail: these are what the RL job imports
    elif job == "evaluate":
        # like the RL job's entry, it starts the engines before its body (mlrl.jobs.evaluate_run) and torch
        early = sorted({"torch", "mlrl.jobs.evaluate_run", "mlrl.jobs.rollout_parts"} & set(loaded))
        assert not early, f"the evaluation's entry imported {early} before starting its engines"
        trunk = sorted((set(RL_TRUNK) - {"mlrl.rollout.pool"}) & set(job_loaded))
        assert not trunk, f"{recipe}: the RL trunk was imported: {trunk}"
        assert "mlrl.rollout.pool" in job_loaded  # (the check above can fail: the body imports the engines)
    else:
        trunk = sorted(set(RL_TRUNK) & set(job_loaded))
        assert not trunk, f"{recipe}: the RL trunk was imported: {trunk}"


def test_validating_a_cpu_config_does_not_import_torch_a_gpu_config_probes_cuda():
    """The launcher validates before the RL job's engines start: a CPU config is checked without
    torch's ~1.2 s import; a GPU config imports it to find CUDA (this machine has none: an error)."""
    code = (
        "import json, sys\n"
        "from mlrl.config import ConfigError, load_config, validate\n"
        "for o in ([], ['cluster.gpus_per_node=1']):\n"
        f"    cfg = load_config({str(ROOT / 'launch' / 'cpu_default.yaml')!r}, o)\n"
        "    try:\n"
        "        validate(cfg); err = ''\n"
        "    except ConfigError as e:\n"
        "        err = str(e)\n"
        "    print(json.dumps([err, 'torch' in sys.modules]))\n"
    )
    code += "import torch; print(json.dumps(['cuda', torch.cuda.is_available()]))\n"
    (cpu_err, cpu_torch), (gpu_err, gpu_torch), (_, has_cuda) = _modules_after(code)
    assert cpu_err == "" and not cpu_torch
    assert gpu_torch  # the GPU config probed CUDA
    if not has_cuda:
        assert "cluster.gpus_per_node=1 but this machine has no CUDA device" in gpu_err

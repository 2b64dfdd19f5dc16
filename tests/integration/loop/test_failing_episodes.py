"""A run whose every episode fails stops, loudly (workflow.max_failure_fraction /
max_failure_steps, mlrl.workflow.failures): AReaL's add-workflow example, imports changed to mlrl,
through `python -m mlrl.launch` on the CPU default. Before, all 512 episodes of every step
failed, the run trained on nothing, wrote a checkpoint and an HF export, and exited 0."""

import subprocess
import sys

from helpers.launching import ROOT

WORKFLOW = "tests.integration.loop.workflows.areal_add_workflow.AddWorkflow"


def test_a_run_whose_episodes_all_fail_stops_with_exit_1_and_the_first_traceback(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "mlrl.launch", "--config", "launch/cpu_default.yaml", f"workflow.name={WORKFLOW}",
           "trainer.prompts_per_step=4", "trainer.samples_per_prompt=2", "trainer.total_steps=3",
           "logging.progress_bar=false", f"logging.run_dir={run}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, (out.returncode, out.stderr[-4000:])
    err = out.stderr
    assert "run stopped: step 1: all 8 episodes failed; the run stops without training on them." in err, err[-4000:]
    # the first episode's own error and traceback, down to the workflow's line
    assert "first failure: TypeError" in err and "input_ids" in err and "'input_ids'" in err, err[-4000:]
    assert "areal_add_workflow.py" in err and "in arun_episode" in err, err[-4000:]
    # nothing trained, nothing saved: no step in the metrics, no checkpoint, no HF export
    lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
    assert lines == []
    assert not list(run.glob("checkpoints/step_*")) and not (run / "hf").exists()

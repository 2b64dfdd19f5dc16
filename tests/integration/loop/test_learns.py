"""mlrl learns a multi-token-answer task within the step budget TRL needs for it (issue 29).

The task and every setting are tools/bench_learning.py's `copy_pair` (two-token answers "copy 3 7"
-> "3 7", partial credit per word, 64 prompts x 8 samples, lr 1e-3, no KL: launch/cpu_default.yaml
plus the task), with rollout seed 1 so the run is reproducible step for step. TRL's GRPOTrainer on
the same model, rows, order and settings reached the threshold (a 3-step mean reward of 0.8) in
TRL_STEPS steps (median of seeds 1-3, measured with the suite on a 2-core machine); mlrl must
reach it within 1.2x that. The run is stopped as soon as it has (SIGTERM: the orderly teardown).

Asserted too: the train/rollout logprob gap stays at float32 rounding, and every sample of every
step was trained on (no group lost to the multi-token path).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TRL_STEPS = 67  # TRL 1.16 GRPOTrainer: 60 / 72 / 67 steps for seeds 1-3 (bench_learning.py --tasks copy_pair)
BUDGET = int(1.2 * TRL_STEPS)
THRESHOLD, WINDOW = 0.8, 3
TASK = ["trainer.lr=1e-3", "algorithm.kl_coef=0.0", "data.train=synthetic:copy_pair", "workflow.reward=token_match",
        "rollout.sampling.max_new_tokens=2", "trainer.samples_per_prompt=8", "trainer.prompts_per_step=64"]


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip().endswith("}")]


def test_a_two_token_task_learns_within_trls_budget(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "mlrl.launch", "--config", "launch/cpu_default.yaml", *TASK,
           f"trainer.total_steps={BUDGET}", "trainer.seed=1", "rollout.sampling.seed=1", f"logging.run_dir={run_dir}",
           "logging.progress_bar=false", "logging.plot=false", "rollout.startup_timeout_s=600",
           "checkpoint.save_at_end=false", "checkpoint.hf_export_at_end=false"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    reached = None
    deadline = time.time() + 900
    try:
        while p.poll() is None and time.time() < deadline:
            rewards = [r["reward/mean"] for r in _records(run_dir / "metrics.jsonl") if "reward/mean" in r]
            for k in range(WINDOW, len(rewards) + 1):
                if sum(rewards[k - WINDOW:k]) / WINDOW >= THRESHOLD:
                    reached = k
                    break
            if reached is not None:
                p.send_signal(signal.SIGTERM)
                break
            time.sleep(0.5)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    recs = [r for r in _records(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert p.returncode in (0, 143), f"launch failed ({p.returncode}):\n{out[-2000:]}\n{err[-4000:]}"
    curve = [round(r["reward/mean"], 3) for r in recs]
    assert reached is not None, f"no {WINDOW}-step mean reward >= {THRESHOLD} within {BUDGET} steps: {curve}"
    for r in recs:
        assert r["train/mismatch/logprob_gap"] < 1e-5, r
        assert r["samples/trainable"] == r["samples/total"] == 64 * 8
    assert recs[0]["response/tokens_mean"] > 1.5  # two-token answers (not one token and EOS)

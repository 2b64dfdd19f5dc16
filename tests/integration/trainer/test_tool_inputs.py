"""Every tool meets bad input with one line naming the problem and exit 2, before any rank, engine
or run starts (tools/tool_errors.py): no traceback, no torchrun. compare_hf_megatron's own cases
are in test_compare_tool_cli.py, convert_checkpoint's in tests/integration/checkpoint."""

import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[3] / "tools"

CASES = [
    ("bench_train_step.py", ["--hf-dir", "/nope"], "bench_train_step: model.hf_dir: '/nope' is not a Hugging Face"),
    ("bench_train_step.py", ["--tp", "2"], "bench_train_step: parallel.tp=2 must divide the model's "
                                           "num_attention_heads=9"),
    ("bench_weight_sync.py", ["--model", "/nope"], "bench_weight_sync: model.hf_dir: '/nope' is not a Hugging Face"),
    ("bench_async.py", ["--config", "/nope.yaml"], "bench_async: config file '/nope.yaml' does not exist"),
    ("bench_async.py", ["trainer.lr=-1"], "bench_async: trainer.lr: got -1.0, expected > 0"),
    ("bench_engine_start.py", ["--models", "builtin:nope"], "bench_engine_start: model.hf_dir: unknown builtin model "
                                                            "'nope'"),
    ("bench_vs_trl.py", ["--config", "/nope.yaml"], "bench_vs_trl: config file '/nope.yaml' does not exist"),
    ("bench_startup.py", ["--recipes", "/nope.yaml"], "bench_startup: recipe /nope.yaml does not exist"),
    ("bench_learning.py", ["--tasks", "nope", "--quick"], "bench_learning: unknown task(s) nope; known: copy_digit"),
    ("bench_generate.py", ["--shapes", "nope"], "bench_generate: --shapes: unknown nope; known: copy_digit"),
    ("bench_generate.py", ["--repeats", "1"], "bench_generate: --repeats must be >= 2"),
    ("bench_ckpt_save.py", ["--repeats", "0"], "bench_ckpt_save: --repeats must be >= 1, got 0"),
    ("bench_ckpt_save.py", ["--mb", "0"], "bench_ckpt_save: --mb must be > 0, got 0.0"),
    ("bench_run_end.py", ["--recipes", "nope"], "bench_run_end: --recipes: unknown nope; known: rl, sft"),
    ("bench_run_end.py", ["--repeats", "0"], "bench_run_end: --repeats must be >= 1, got 0"),
    ("bench_agent_http.py", ["--concurrency", "0,8"], "bench_agent_http: --concurrency must be positive integers, "
                                                      "got '0,8'"),
    ("bench_agent_http.py", ["--repeats", "0"], "bench_agent_http: --repeats must be >= 1, got 0"),
    ("bench_rank_start.py", ["--recipes", "/nope.yaml"], "bench_rank_start: recipe /nope.yaml does not exist"),
    ("bench_rank_start.py", ["--tp", "0"], "bench_rank_start: --tp must list layouts >= 1, got '0'"),
]


@pytest.mark.parametrize("tool,args,line", CASES, ids=[f"{t[:-3]}:{' '.join(a)}" for t, a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(tool, args, line):
    proc = subprocess.run([sys.executable, str(TOOLS / tool), *args], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [x for x in proc.stderr.splitlines() if x.strip() and "Warning" not in x and "warnings.warn" not in x]
    assert lines == [lines[-1]] and lines[-1].startswith(line), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "torch.distributed" not in proc.stderr

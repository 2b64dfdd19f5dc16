"""tools/bench_train_step.py runs end to end (tiny model, one timed step) and reports both rates."""

import json
import subprocess
import sys
import time
from pathlib import Path

TOOL = Path(__file__).resolve().parents[3] / "tools" / "bench_train_step.py"


def test_bench_reports_megatron_and_hf_rates(tmp_path):
    out = tmp_path / "bench.json"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--hf-dir",
            "builtin:tiny-llama",
            "--samples",
            "4",
            "--sample-len",
            "16",
            "--steps",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["tokens_per_step"] == 64 and res["megatron_ranks"] == 1
    # the cpu default: 2 micro-batches of 2 samples x 16 tokens, host memory not planned
    assert (res["micro_batches"], res["micro_batch_tokens"], res["planned_train_gb"]) == (2, 32, None)
    # seconds per step implied by the rates: each side ran 1 warm-up + 1 timed step inside this
    # process's wall time, and a train step (forward, backward, optimizer) takes more than 1 ms
    mg_s, hf_s = 64 / res["megatron_tokens_per_s"], 64 / res["hf_tokens_per_s"]
    assert 1e-3 < mg_s and 1e-3 < hf_s and 2 * (mg_s + hf_s) < wall, (mg_s, hf_s, wall)
    assert abs(res["ratio_megatron_over_hf"] - hf_s / mg_s) < 1e-6 * res["ratio_megatron_over_hf"]

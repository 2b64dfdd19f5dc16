"""tools/bench_train_step.py runs end to end (tiny model, one timed step) and reports both rates."""

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[3] / "tools" / "bench_train_step.py"


def test_bench_reports_megatron_and_hf_rates(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(TOOL), "--hf-dir", "builtin:tiny-llama", "--samples", "4", "--sample-len", "16",
                           "--steps", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["tokens_per_step"] == 64
    assert res["megatron_tokens_per_s"] > 0 and res["hf_tokens_per_s"] > 0
    assert abs(res["ratio_megatron_over_hf"] - res["megatron_tokens_per_s"] / res["hf_tokens_per_s"]) < 1e-6 * res["ratio_megatron_over_hf"] + 1e-9

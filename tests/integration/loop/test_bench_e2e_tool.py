"""tools/bench_e2e_gpu.py end to end on CPU: a tiny random-weight model, a colocated GRPO run launched
through `python -m mlrl.launch` (one warm-up and one timed step, 2 prompts x 2 samples x 8 tokens),
its metrics read back, the copy measured, and a report whose numbers are all there and positive,
ending with `ratio refit_vs_copy: <float>`. ~60 s on 2 cores."""

import re
import subprocess
import sys

import pytest
from helpers.tools import TOOLS

pytestmark = pytest.mark.timeout(400)
NUMBER = r"(\d+(?:\.\d+)?)"


def _number(text: str, pattern: str) -> float:
    m = re.search(pattern, text, re.M)
    assert m, f"no line matching {pattern!r} in:\n{text}"
    return float(m.group(1))


def test_bench_e2e_reports_positive_numbers_on_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "bench_e2e_gpu.py"), "--device", "cpu", "--model-shape", "tiny",
         "--prompts", "2", "--group-size", "2", "--max-new-tokens", "8", "--steps", "1", "--warmup", "1",
         "--run-dir", str(tmp_path / "run"), "--timeout", "240"],  # the tool stops a stuck run itself (SIGTERM)
        capture_output=True, text=True, timeout=330,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert _number(out, r"^steps timed: (\d+)$") == 2  # step 1 is the warm-up
    # min_new_tokens = max_new_tokens: every sample is exactly 8 tokens
    assert _number(out, rf"mean response length {NUMBER} tokens") == 8.0
    assert _number(out, rf"^generated tokens per step: {NUMBER}$") == 2 * 2 * 8
    for pattern in (rf"^generated tok/s per device \(CPU\): {NUMBER}", rf"^generation tok/s: {NUMBER}",
                    rf"^step time: {NUMBER} s", rf"^  rollout\s+{NUMBER}", rf"^  logprobs\s+{NUMBER}",
                    rf"^  train\s+{NUMBER}", rf"^  sync\s+{NUMBER}", rf"^  sleep\s+{NUMBER}", rf"^  wake\s+{NUMBER}",
                    rf"^  offload\s+{NUMBER}", rf"^  reload\s+{NUMBER}", rf"^refit \(timing/sync\): {NUMBER} s",
                    rf"^copy of the parameter bytes \({NUMBER} MB", rf"\): {NUMBER} ms \(",
                    rf"^peak memory: {NUMBER} GiB"):
        assert _number(out, pattern) > 0, pattern
    last = out.strip().splitlines()[-1]
    m = re.fullmatch(rf"ratio refit_vs_copy: {NUMBER}", last)
    assert m and float(m.group(1)) > 0, last
    # the run was the real thing: its metrics say colocated, synced and trained
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 2 and '"colocate/sleep_level": 1.0' in metrics[-1] and '"train/updates"' in metrics[-1]

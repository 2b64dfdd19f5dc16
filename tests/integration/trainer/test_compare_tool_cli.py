"""tools/compare_hf_megatron.py's inputs and exit codes: a model folder without tokenizer files
(what a converted or randomly initialised checkpoint looks like) is compared on seeded random
token ids, and says so; exit 0 at parity, 1 above the bound, 2 for bad input before any rank
starts, 3 when the comparison does not complete."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlrl.modelzoo import resolve_model_dir

TOOL = Path(__file__).resolve().parents[3] / "tools" / "compare_hf_megatron.py"


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """builtin tiny-llama's config and weights only: no tokenizer files."""
    src, out = resolve_model_dir("builtin:tiny-llama"), tmp_path_factory.mktemp("bare") / "tiny-llama"
    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, out / name)
    return out


def _run(*args, timeout=600, tmpdir: Path | None = None):
    env = dict(os.environ, TMPDIR=str(tmpdir)) if tmpdir else None
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_no_tokenizer_compares_random_tokens_and_passes(bare, tmp_path):
    out, scratch = tmp_path / "res.json", tmp_path / "tmp"
    scratch.mkdir()
    proc = _run("--hf-dir", str(bare), "--json", str(out), tmpdir=scratch)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not list(scratch.glob("compare_hf_megatron.*"))  # the verdict's scratch folder is removed
    assert not list(scratch.glob("torchelastic_*"))  # and torchrun made none (--log-dir=/dev/null)
    assert f"{bare} has no tokenizer: comparing on seeded random token ids (--random-tokens)" in proc.stdout
    res = json.loads(out.read_text())
    assert res["inputs"] == "random token ids" and res["ok"] and res["tokens"] >= 5 * 8
    assert res["max_abs_logprob"] <= 1e-5


def test_a_parity_failure_exits_1(bare, tmp_path):
    """--tol 0: Megatron's kernels and HF's reduce in other orders, so some difference is > 0."""
    out = tmp_path / "res.json"
    proc = _run("--hf-dir", str(bare), "--tol", "0", "--json", str(out))
    res = json.loads(out.read_text())
    assert max(res["max_abs_logits"], res["max_abs_logprob"]) > 0 and not res["ok"]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "-> FAIL" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--no-random-tokens"], "has no tokenizer (tokenizer.json, tokenizer.model, vocab.json, tokenizer_config.json): "
                             "drop --no-random-tokens"),
    (["--tp", "0"], "--tp must be >= 1, got 0"),
    (["--tp", "3"], "parallel.tp=3 must divide"),
])
def test_bad_input_exits_2_before_any_rank(bare, args, message):
    proc = _run("--hf-dir", str(bare), *args, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, (proc.returncode, proc.stderr[-2000:])
    assert "torch.distributed" not in proc.stderr and "Traceback" not in proc.stderr  # no rank ever started


def test_a_missing_folder_exits_2(tmp_path):
    proc = _run("--hf-dir", str(tmp_path / "nope"), timeout=120)
    assert proc.returncode == 2 and "is not a Hugging Face model folder (no config.json)" in proc.stderr


def test_a_comparison_that_does_not_complete_exits_3(bare, tmp_path):
    """3 s: torchrun's workers are up (importing or comparing; a whole comparison takes ~10 s here).
    They run in sessions of their own and hold the captured pipes: if the timeout left them running,
    `_run` would wait for them and time out itself (what CI saw when only torchrun's group was killed)."""
    proc = _run("--hf-dir", str(bare), "--timeout", "3", timeout=120, tmpdir=tmp_path)
    assert proc.returncode == 3 and "timed out after 3 s" in proc.stderr
    assert not list(tmp_path.glob("compare_hf_megatron.*"))  # removed on a timeout too

"""tools/convert_checkpoint.py: HF -> Megatron -> HF is bit-exact (SmolLM2-135M across a PP
change, tiny qwen3_moe at EP2), `--verify` reports the logits gap, and bad inputs fail with one
line naming the problem before any process starts."""

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mlrl.modelzoo import resolve_model_dir

REPO = Path(__file__).resolve().parents[3]
TOOL = REPO / "tools" / "convert_checkpoint.py"


def _tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_tool(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=timeout,
                          env={**__import__("os").environ, "PYTHONWARNINGS": "ignore"})


def _tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_model(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    different = [n for n in ta if ta[n].dtype != tb[n].dtype or not ta[n].equal(tb[n])]
    assert different == [], different[:5]
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (b / f).is_file():
            assert json.loads((a / f).read_text()) == json.loads((b / f).read_text()), f


def _gap(stdout: str) -> float:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("verify ok"))
    return float(line.split("difference| ")[1].split(" ")[0])


def test_smollm2_roundtrip_is_bit_exact(tmp_path):
    src = resolve_model_dir("builtin:smollm2-135m-instruct")
    t0 = time.perf_counter()
    r = run_tool("hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "mcore"), "--pp", "2", "--verify")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "hf-to-mcore:" in r.stderr  # the progress bar
    t1 = time.perf_counter()
    r2 = run_tool("mcore-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf"), "--pp", "1",
                  "--max-shard-size", "200MB", "--no-progress")
    assert r2.returncode == 0, r2.stderr[-3000:]
    t2 = time.perf_counter()
    meta = json.loads((tmp_path / "mcore" / "mlrl_checkpoint.json").read_text())
    assert meta["layout"]["pp"] == 2 and meta["contents"]["optimizer"] is False
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) >= 3  # 538 MB in <= 200 MB shards
    assert_same_model(tmp_path / "hf", src)
    # fp32, 30 layers: the sharded Megatron model vs transformers; transformers' own floor (the
    # same rows as prefixes of longer sequences) is 6.5e-5 on logits of magnitude ~33
    gap = _gap(r.stdout)
    assert gap <= 1e-3
    print(f"SmolLM2 hf-to-mcore (pp2) {t1 - t0:.1f} s, mcore-to-hf (pp1) {t2 - t1:.1f} s, logit gap {gap:.3g}")


def test_qwen3_moe_ep2_roundtrip_is_bit_exact(tmp_path):
    src = resolve_model_dir("builtin:tiny-qwen3-moe")
    r = run_tool("hf-to-mcore", "--hf", "builtin:tiny-qwen3-moe", "--out", str(tmp_path / "mcore"), "--ep", "2",
                 "--verify", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "mcore" / "mlrl_checkpoint.json").read_text())["layout"]["ep"] == 2
    r2 = run_tool("mcore-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf"), "--verify",
                  "--no-progress")
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "world=2" in r2.stdout  # the checkpoint's own layout (EP2) by default
    assert_same_model(tmp_path / "hf", src)
    assert _gap(r.stdout) <= 1e-4 and _gap(r2.stdout) <= 1e-4


def test_training_checkpoint_to_hf_on_another_layout(saved_tp2, work, tmp_path):
    """A TP2 training checkpoint (optimizer state included) -> HF on one rank: the weights the
    training run itself exported at that step."""
    r = run_tool(
        "mcore-to-hf", "--ckpt", str(work / "tp2_fr"), "--out", str(tmp_path / "hf"), "--tp", "1", "--no-progress"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world=1" in r.stdout
    assert_same_model(tmp_path / "hf", work / "tp2_step2_hf")


# ---- bad inputs: fail in the launching process, before any rank starts ---------------------------
@pytest.fixture(scope="module")
def tool():
    return _tool()


def _error(tool, capsys, *argv: str) -> str:
    rc = tool.main(list(argv))
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.count("\n") == 0 and "error:" in err, err  # one line
    return err


def test_checkpoint_argument_forms(tool, tmp_path):
    """--ckpt accepts model_optim/, step_N/ or a run's checkpoint root (its latest complete one)."""
    from mlrl.checkpoint import CheckpointManager

    manager = CheckpointManager(tmp_path / "ckpts")
    for step in (3, 5):
        t = manager.begin(step)
        (t / "model_optim").mkdir()
        (t / "model_optim" / "metadata.json").write_text("{}")
        manager.commit(t, step, {})
    step5 = tmp_path / "ckpts" / "step_000005" / "model_optim"
    assert tool.resolve_ckpt(str(tmp_path / "ckpts")) == step5
    assert tool.resolve_ckpt(str(step5.parent)) == step5
    assert tool.resolve_ckpt(str(tmp_path / "ckpts" / "step_000003" / "model_optim")).parent.name == "step_000003"


def test_bad_inputs(tool, capsys, tmp_path):
    smol = resolve_model_dir("builtin:smollm2-135m-instruct")
    tiny = resolve_model_dir("builtin:tiny-llama")
    out = str(tmp_path / "out")
    assert "does not exist" in _error(tool, capsys, "hf-to-mcore", "--hf", str(tmp_path / "nope"), "--out", out)
    (tmp_path / "empty").mkdir()
    assert "no config.json" in _error(tool, capsys, "hf-to-mcore", "--hf", str(tmp_path / "empty"), "--out", out)
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    shutil.copy2(tiny / "config.json", noweights / "config.json")
    assert "no *.safetensors" in _error(tool, capsys, "hf-to-mcore", "--hf", str(noweights), "--out", out)
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    conf = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**conf, "model_type": "gpt_bigcode"}))
    assert "gpt_bigcode" in _error(tool, capsys, "hf-to-mcore", "--hf", str(other), "--out", out)
    (other / "config.json").write_text(json.dumps({**conf, "intermediate_size": 2 * conf["intermediate_size"]}))
    assert "shape" in _error(tool, capsys, "hf-to-mcore", "--hf", str(other), "--out", out)
    msg = _error(tool, capsys, "hf-to-mcore", "--hf", str(smol), "--out", out, "--tp", "2")
    assert "num_attention_heads=9" in msg
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert "not empty" in _error(tool, capsys, "hf-to-mcore", "--hf", str(tiny), "--out", str(tmp_path / "full"))
    assert "does not exist" in _error(tool, capsys, "mcore-to-hf", "--ckpt", str(tmp_path / "nope"), "--out", out)
    assert "not an mlrl checkpoint" in _error(
        tool, capsys, "mcore-to-hf", "--ckpt", str(tmp_path / "empty"), "--out", out
    )
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "metadata.json").write_text("{}")
    (partial / "__0_0.distcp").write_text("")
    assert "incomplete" in _error(tool, capsys, "mcore-to-hf", "--ckpt", str(partial), "--out", out)
    assert "--max-shard-size" in _error(tool, capsys, "mcore-to-hf", "--ckpt", str(partial), "--out", out,
                                        "--max-shard-size", "lots")

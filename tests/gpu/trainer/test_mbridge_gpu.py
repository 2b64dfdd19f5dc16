"""model.bridge=megatron-bridge (GPU environment with the `bridge` extra; skipped without CUDA or
without megatron-bridge): a tiny model converted both ways through NVIDIA megatron-bridge's
AutoBridge by tools/convert_checkpoint.py --bridge megatron-bridge.

- HF -> Megatron through megatron-bridge: the checkpoint records the bridge, and the sharded
  model's logits match transformers (--verify);
- Megatron -> HF through megatron-bridge: every tensor equals the source's (fp32), and the
  export's logits match transformers;
- the weight stream equals the built-in bridge's for a model both support (tiny Llama), so
  megatron-bridge's export is what the weight sync would push.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.bridge", reason="megatron-bridge (the GPU environment's `bridge` extra) is not installed")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "checkpoint"))
from helpers.tools import load_tool
from test_convert_checkpoint import _gap, _tensors, run_tool

from mlrl.modelzoo import resolve_model_dir

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("tp", [1, 2] if GPUS >= 2 else [1])
def test_megatron_bridge_converts_tiny_llama_both_ways(tmp_path, tp):
    src = resolve_model_dir("builtin:tiny-llama")
    mcore, hf = tmp_path / "mcore", tmp_path / "hf"
    r = run_tool("hf-to-mcore", "--hf", str(src), "--out", str(mcore), "--tp", str(tp), "--bridge",
                 "megatron-bridge", "--dtype", "float32", "--verify", "--verify-tol", "1e-3", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _gap(r.stdout) <= 1e-3
    meta = json.loads((mcore / "mlrl_checkpoint.json").read_text())
    assert meta["bridge"] == "megatron-bridge" and meta["layout"]["tp"] == tp
    r = run_tool("mcore-to-hf", "--ckpt", str(mcore), "--out", str(hf), "--tp", "1", "--dtype", "float32",
                 "--verify", "--verify-tol", "1e-3", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _gap(r.stdout) <= 1e-3
    a, b = _tensors(src), _tensors(hf)
    assert sorted(a) == sorted(b)
    worst = max(float((a[n].float() - b[n].float()).abs().max()) for n in a)
    assert worst == 0.0, f"megatron-bridge round trip changed a tensor by {worst}"


def test_megatron_bridge_and_builtin_export_the_same_tensors(tmp_path):
    src = resolve_model_dir("builtin:tiny-llama")
    outs = {}
    for bridge in ("builtin", "megatron-bridge"):
        mcore, hf = tmp_path / f"{bridge}-mcore", tmp_path / f"{bridge}-hf"
        r = run_tool("hf-to-mcore", "--hf", str(src), "--out", str(mcore), "--bridge", bridge, "--dtype", "float32",
                     "--no-progress")
        assert r.returncode == 0, r.stderr[-3000:]
        r = run_tool("mcore-to-hf", "--ckpt", str(mcore), "--out", str(hf), "--dtype", "float32", "--no-progress")
        assert r.returncode == 0, r.stderr[-3000:]
        outs[bridge] = _tensors(hf)
    assert sorted(outs["builtin"]) == sorted(outs["megatron-bridge"])
    assert all(outs["builtin"][n].equal(outs["megatron-bridge"][n]) for n in outs["builtin"])


def test_convert_tool_lists_megatron_bridge_when_installed():
    mod = load_tool("convert_checkpoint")
    assert "megatron-bridge" in mod.list_supported() and "not installed" not in mod.list_supported()

"""What the in-run export writes (mlrl.trainer.rank.service.TrainerService.export_hf and
mlrl.trainer.rank.hf_export.export_peft), with a stand-in policy on a one-process gloo group: the
trained parameters' dtype is kept, and a LoRA adapter names the base it was trained on."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mlrl.config.schema import LoRAConfig

pytestmark = pytest.mark.usefixtures("one_gloo_rank")


def _lora_policy(tmp_path: Path, init_from=None):
    cfg = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj"])
    return SimpleNamespace(
        ranks=SimpleNamespace(rank=0), lora=SimpleNamespace(cfg=cfg), hf_dir=tmp_path / "hf_dir", init_from=init_from,
        hf_config={"torch_dtype": "bfloat16"},
        gather_adapters=lambda: {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 8),
                                 "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(8, 4)})


def test_the_adapter_names_the_base_it_was_trained_on(tmp_path):
    """model.init_from=<an HF folder>: the frozen base is that folder (model.hf_dir only gave the
    shape); the adapter named model.hf_dir, so peft loaded it onto another model."""
    from mlrl.trainer.rank.hf_export import export_peft

    sft = tmp_path / "sft_export"
    out = export_peft(_lora_policy(tmp_path, SimpleNamespace(kind="hf", weights=sft, path=sft)), tmp_path / "a")
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(sft)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000040"  # a base from an mlrl checkpoint: named as such
    source = SimpleNamespace(kind="checkpoint", weights=ckpt / "model_optim", path=ckpt)
    out = export_peft(_lora_policy(tmp_path, source), tmp_path / "b")
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(ckpt)
    out = export_peft(_lora_policy(tmp_path), tmp_path / "c")  # no init_from: model.hf_dir
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "hf_dir")


def test_the_run_exports_in_the_trained_dtype(tmp_path, monkeypatch):
    """An fp32 run of a model whose config.json says bfloat16 exported bf16 weights (config.json's
    dtype), rounding most of a small-LR update away; it now keeps the parameters' dtype, as
    transformers' save_pretrained does (tools/convert_checkpoint.py --dtype converts)."""
    from mlrl.trainer.rank import hf_export
    from mlrl.trainer.rank.service import TrainerService

    calls = []
    monkeypatch.setattr(hf_export, "export_hf", lambda policy, out, **kw: calls.append(("hf", kw)))
    monkeypatch.setattr(hf_export, "export_peft", lambda policy, out, **kw: calls.append(("peft", kw)))
    service = object.__new__(TrainerService)
    service.policy = SimpleNamespace(lora=object())
    service.cfg = SimpleNamespace(checkpoint=SimpleNamespace(export_merged=True))
    service.export_hf(str(tmp_path / "out"))
    assert calls == [("hf", {"dtype": None}), ("peft", {"dtype": None})]
    monkeypatch.undo()  # dtype=None keeps the fp32 adapters of a policy whose config.json says bfloat16
    from safetensors.torch import load_file

    for dtype, want in ((None, torch.float32), ("auto", torch.bfloat16)):
        folder = hf_export.export_peft(_lora_policy(tmp_path), tmp_path / f"kept_{dtype}", dtype=dtype)
        assert {t.dtype for t in load_file(str(folder / "adapter_model.safetensors")).values()} == {want}

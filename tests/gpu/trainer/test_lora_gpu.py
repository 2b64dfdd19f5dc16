"""LoRA on the Transformer Engine layer spec (skipped without CUDA): the adapters hook
TEColumnParallelLinear / TERowParallelLinear, with the fused TE layernorm-linears unfused into
TENorm + linear (the adapter needs the normalised input). Runs the CPU LoRA worker
(tests/integration/trainer/lora_worker.py) on GPUs: reference phase on one GPU, plus TP2 /
TP2+SP / PP2 with two. The LoRA policy's kernels differ from the fused base policy's, so
"identical" checks become fp32 tolerances here."""

import sys
from pathlib import Path

import pytest
import torch

INTEGRATION = Path(__file__).resolve().parents[2] / "integration"
sys.path.insert(0, str(INTEGRATION / "trainer"))

from trainer_harness import run_torchrun  # noqa: E402

WORKER = INTEGRATION / "trainer" / "lora_worker.py"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize(
    "nproc", [1, pytest.param(2, marks=pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, found {GPUS}"))]
)
def test_lora_on_the_te_spec(nproc):
    layouts = "tp2,tp2+sp,pp2" if nproc == 2 else ""
    ranks, _ = run_torchrun(WORKER, ["--layouts", layouts], nproc)
    for r in ranks:
        ref = r["ref"]
        assert ref["b0_err"] <= 1e-4 and ref["disabled_err"] <= 1e-4
        assert ref["base_unchanged"] and ref["trainable"] == ["lora_A", "lora_B"]
        assert ref["losses"][2] < ref["losses"][0]
        assert ref["merged_err"] <= 1e-4
        assert ref["resume"]["loss_equal"] and ref["resume"]["adapters_equal"]
        for name in filter(None, layouts.split(",")):
            assert r[name]["after_err"] <= 1e-3 and r[name]["merged_err"] <= 1e-4
    assert ranks[0]["ref"]["peft"]["logits_err"] <= 1e-4

"""DPO / IPO parity: the Megatron policy's DPO and IPO losses and gradients on real preference pairs
equal a plain PyTorch DPO on the Hugging Face model within 1e-6 (fp32), at TP1/DP2, TP2 and PP2;
two gloo ranks, one torchrun launch (dpo_parity_worker.py)."""

import math
from pathlib import Path

import pytest
from trainer_harness import run_torchrun

WORKER = Path(__file__).with_name("dpo_parity_worker.py")
LAYOUTS = ["ref", "tp2", "pp2"]  # ref = tp1 / dp2
TOL = 1e-6


@pytest.fixture(scope="module")
def ranks():
    results, _ = run_torchrun(WORKER, ["--layouts", ",".join(LAYOUTS)], 2, timeout=400)
    return results


def test_the_reference_is_not_trivial(ranks):
    hf = ranks[0]["hf"]
    # policy != reference: the loss is not the untrained log 2 and the gradients are not tiny
    assert abs(hf["loss"]["sigmoid"] - math.log(2)) > 1e-3, hf["loss"]
    assert min(hf["grad_max"].values()) > 1e-3, hf["grad_max"]
    # pairs of mixed lengths (arith_word prompts, 1-, 2- and 4-token answers, a string-format pair)
    lengths = [n for pair in hf["lengths"] for n in pair]
    assert min(lengths) < 8 and max(lengths) > 20 and len(hf["lengths"]) == 9


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_and_grads_match_plain_pytorch(ranks, layout, loss_type):
    hf = ranks[0]["hf"]
    names = set()
    for r in ranks:
        got = r[layout][loss_type]
        assert got["pairs"] == 9
        assert abs(got["loss"] - hf["loss"][loss_type]) <= TOL, (layout, loss_type, got["loss"], hf["loss"])
        assert got["grad_err"] <= TOL, (layout, loss_type, got["grad_err"])
        names |= set(got["grad_names"])
        if layout == "ref":
            assert got["micro_batches"] >= 2  # the step is split: pair weights span micro-batches and DP ranks
    assert names == set(hf["names"])  # together the ranks compared every HF parameter's gradient

"""Trainer offload / reload (colocated placement) on two gloo ranks, one torchrun launch (offload_worker.py)."""

from pathlib import Path

import pytest
from trainer_harness import run_torchrun

WORKER = Path(__file__).with_name("offload_worker.py")
LAYOUTS = ["ref", "tp2", "bf16"]


@pytest.fixture(scope="module")
def ranks():
    results, _ = run_torchrun(WORKER, ["--layouts", ",".join(LAYOUTS)], 2, timeout=400)
    return results


@pytest.mark.parametrize("layout", LAYOUTS)
def test_offload_releases_every_storage_and_reload_is_bit_identical(ranks, layout):
    for r in ranks:
        got = r[layout]
        assert got["n_tensors"] > 0
        for kind in ("params", "grads", "optimizer"):
            assert got["resident"][kind] > 0, (kind, got["resident"])
            assert got["after_offload"][kind] == 0, (kind, got["after_offload"])  # every storage released
            assert got["offload"]["bytes"][kind] > 0
            assert got["reload"]["bytes"][kind] == got["offload"]["bytes"][kind]
        # gradients are released without a copy (the next step zeroes them); the rest is copied
        assert got["offload"]["copied"] == got["offload"]["bytes"]["params"] + got["offload"]["bytes"]["optimizer"]
        assert got["again"]["bytes"] == {} and got["again"]["copied"] == 0
        assert got["identical"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_next_step_equals_a_twin_that_never_offloaded(ranks, layout):
    for r in ranks:
        got = r[layout]
        assert got["loss"][0] == got["loss"][1] and got["grad_norm"][0] == got["grad_norm"][1], got
        assert got["next_step_params_equal"]


def test_params_stay_usable_with_optimizer_and_grads_offloaded(ranks):
    for r in ranks:
        for layout in LAYOUTS:
            got = r[layout]
            assert got["stream_ok"]
            assert set(got["partial"]["bytes"]) == {"optimizer", "grads"}


def test_bf16_master_weights_move_with_the_optimizer(ranks):
    """bf16: parameters take about half the bytes of fp32 (a few stay fp32, e.g. the critic's value head),
    and the optimizer's fp32 master copies count as optimizer bytes (in fp32 the distributed optimizer's
    main parameters are views of the parameters themselves, which count once, as params)."""
    for r in ranks:
        fp32, bf16 = r["ref"]["offload"]["bytes"], r["bf16"]["offload"]["bytes"]
        assert 0.45 * fp32["params"] < bf16["params"] < 0.55 * fp32["params"]
        assert bf16["optimizer"] > 1.4 * fp32["optimizer"]

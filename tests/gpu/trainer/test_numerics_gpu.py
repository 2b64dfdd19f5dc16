"""trainer.deterministic on a real GPU (skipped without CUDA). Before, `true` (then the default)
crashed every trainer build: megatron-core refuses TE's DotProductAttention in deterministic mode
unless NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, which mlrl never set. Now each rank sets it
(mlrl.trainer.rank.numerics) and the default `auto` is off on GPU. Runs the CPU integration
worker (tests/integration/trainer/trainer_worker.py) on one GPU."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "trainer"))

from trainer_harness import assert_grads, run_worker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_deterministic_true_builds_on_te_and_repeats_bit_for_bit():
    """Two fresh processes, same step: identical losses and identical gradient errors against the
    same HF reference, to the last bit (a nondeterministic kernel, e.g. an atomic-add attention
    backward, changes low bits from run to run); and the gradients still match HF."""
    runs = [run_worker(1, checks=["grads"], models=["tiny-qwen3"], trainer_opts={"deterministic": "true"})
            for _ in range(2)]
    a, b = (r[0]["tiny-qwen3/grads"] for r in runs)
    for key in ("loss_1", "loss_4", "grad_err_1", "grad_err_4", "split_grad_diff"):
        assert a[key] == b[key], (key, a[key], b[key])
    assert_grads(runs[0], "tiny-qwen3", tol=1e-5)

"""checkpoint.async_save on GPU (skipped without CUDA): megatron-core writes the shards in the
background while training goes on; the checkpoint folder holds no mlrl_checkpoint.json and the
run directory no complete checkpoint until `finalize_async_saves` has run on every rank; after
the finalize and the commit, a fresh policy resumed from resolve_resume('auto') holds the saving
policy's weights at save time, bit for bit, and its next step equals the saving policy's.
Runs the `async_save` phase of the CPU checkpoint worker (tests/integration/checkpoint)."""

import sys
from pathlib import Path

import pytest
import torch

INTEGRATION = Path(__file__).resolve().parents[2] / "integration"
sys.path.insert(0, str(INTEGRATION / "trainer"))

from trainer_harness import run_torchrun  # noqa: E402

WORKER = INTEGRATION / "checkpoint" / "ckpt_worker.py"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize(
    "nproc", [1, pytest.param(2, marks=pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, found {GPUS}"))]
)
def test_async_save_completes_only_after_finalize_and_resumes_bit_exact(tmp_path, nproc):
    ranks, _ = run_torchrun(
        WORKER, ["--work", str(tmp_path), "--model", "tiny-llama", "--phases", "async_save:gpu"], nproc
    )
    for r in ranks:  # nproc=2: DP2, the finalize agreed on over both ranks
        a = r["async_save:gpu"]
        assert a["async_queue_used"]                                   # the background writer really ran
        assert not a["meta_before_finalize"] and a["resume_before_finalize"] is None
        assert a["pending_after_blocking_finalize"] == 0 and a["meta_after_finalize"]
        assert a["resumed_from"] == "step_000002"
        assert a["info"]["optimizer_loaded"] and a["info"]["optimizer_steps"] == 2
        assert a["same_weights_as_at_save"]                            # bit for bit, not the weights after step 3
        assert a["loss_b3"] == a["loss_a3"] and a["same_weights_after_step3"]
    assert ranks[0]["async_save:gpu"]["weights_compared"] > 0          # rank 0 is the stage sender: it compared

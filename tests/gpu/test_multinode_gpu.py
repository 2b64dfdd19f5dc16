"""`--nodes 2` on real GPUs (skipped below 2 GPUs): a Ray cluster simulated on one GPU machine, each
worker node owning one physical GPU (its raylet's CUDA_VISIBLE_DEVICES). The trainer ranks take the
TE / NCCL path, the engines the CUDA build of vLLM, and the weight sync NCCL between them (which
refuses two ranks on one GPU, hence two), with the same placement code as a real cluster. Written
against the real APIs; never run: the GPU machines lent so far have one GPU and no Ray."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count()
# Both runs sync by NCCL broadcast (cuda_ipc is single-node), and NCCL refuses two ranks of one
# communicator on the same GPU ("Duplicate GPU detected"): the trainer and the engine need a GPU each.
pytestmark = [pytest.mark.timeout(1800),
              pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs (NCCL sync between trainer and engine), found {GPUS}")]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    try:
        for gpu in range(2):  # each simulated node owns its own physical GPU (the raylet's CUDA_VISIBLE_DEVICES)
            c.add_node(num_cpus=4, num_gpus=1, env_vars={"CUDA_VISIBLE_DEVICES": str(gpu)})
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()


@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_two_node_gpu_run(cluster, tmp_path, placement):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "mlrl.launch",
        "--nodes",
        "2",
        "cluster.gpus_per_node=1",
        f"cluster.placement={placement}",
        f"cluster.ray_address={cluster.address}",
        "rollout.num_engines=1" if placement == "disaggregated" else "rollout.num_engines=2",
        # colocated: NCCL cannot hold a trainer rank and an engine worker of one GPU in a group
        "weight_sync.transport=broadcast" if placement == "disaggregated" else "weight_sync.transport=disk",
        "rollout.gpu_memory_utilization=0.3",
        "trainer.total_steps=2",
        "trainer.prompts_per_step=4",
        "trainer.samples_per_prompt=4",
        "logging.progress_bar=false",
        f"logging.run_dir={run_dir}",
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500, env=dict(os.environ))
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-8000:]}"
    place = json.loads((run_dir / "placement.json").read_text())
    assert all(n["cuda"] for n in place["nodes"])
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["weight_sync/canary_max_abs_diff"] <= 2e-2, r  # bf16/TF32 kernels on both sides
        assert r["episodes/failures"] == 0

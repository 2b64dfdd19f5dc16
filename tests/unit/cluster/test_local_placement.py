"""One machine with GPUs: the plan's split of the GPUs between trainer ranks and engines becomes
CUDA_VISIBLE_DEVICES for torchrun and per-engine devices, through the caller's own visible set."""

from pathlib import Path

import pytest

from mlrl.config import ConfigError, load_config, validate
from mlrl.jobs.placement import local_placement

ROOT = Path(__file__).resolve().parents[3]


def _placement(*overrides):
    cfg = load_config(ROOT / "launch" / "qwen3_8b_grpo.yaml", ["cluster.nodes=1", "cluster.gpus_per_node=8",
                                                                "cluster.gpu_memory_gb=1000", *overrides])
    return local_placement(cfg, validate(cfg, dry_run=True))


def test_cpu_run_places_nothing():
    cfg = load_config(ROOT / "launch" / "cpu_default.yaml")
    p = local_placement(cfg, validate(cfg, has_cuda=False))
    assert (p.trainer_env, p.engine_devices, p.spawn_trainer, p.engine_server, p.host) == (
        {},
        None,
        None,
        None,
        "127.0.0.1",
    )


def test_disaggregated_split(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    p = _placement("rollout.num_engines=2", "rollout.engine_tp=2", "parallel.tp=2", "parallel.pp=1")
    assert p.trainer_env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert p.engine_devices == [[4, 5], [6, 7]]


def test_split_maps_through_the_callers_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "8,9,10,11,12,13,14,15")
    p = _placement("rollout.num_engines=2", "rollout.engine_tp=2", "parallel.tp=2", "parallel.pp=1")
    assert p.trainer_env == {"CUDA_VISIBLE_DEVICES": "8,9,10,11"} and p.engine_devices == [[12, 13], [14, 15]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ConfigError, match="cluster.gpus_per_node=8 but CUDA_VISIBLE_DEVICES=0,1 lists 2"):
        _placement("rollout.num_engines=2", "rollout.engine_tp=2", "parallel.tp=2", "parallel.pp=1")
    # GPU UUIDs (CUDA accepts them): one line naming the variable, not a ValueError traceback
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(f"GPU-5f0e{i}" for i in range(8)))
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=GPU-5f0e0,.*list the GPUs by index"):
        _placement("rollout.num_engines=2", "rollout.engine_tp=2", "parallel.tp=2", "parallel.pp=1")


def test_colocated_engines_share_the_trainer_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    p = _placement(
        "cluster.placement=colocated", "rollout.num_engines=4", "rollout.engine_tp=2", "parallel.tp=2", "parallel.pp=1",
        "weight_sync.transport=disk",
    )
    assert p.trainer_env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert p.engine_devices == [[0, 1], [2, 3], [4, 5], [6, 7]]

"""cluster.placement=colocated and cluster.colocate: what validation accepts and what it refuses, by name."""

from pathlib import Path

import pytest

from mlrl.config import ConfigError, load_config, validate

DEFAULT = Path(__file__).resolve().parents[3] / "launch" / "cpu_default.yaml"
COLO = "cluster.placement=colocated"

BAD = [
    (["cluster.colocate.offload_params=true"], "cluster.colocate (ColocateConfig(sleep_level=1, offload_params=True)) "
     "applies only to cluster.placement=colocated"),
    (["cluster.colocate.sleep_level=2"], "applies only to cluster.placement=colocated"),
    ([COLO, "cluster.colocate.sleep_level=3"], "cluster.colocate.sleep_level=3: vLLM's sleep levels are 1"),
    ([COLO, "cluster.colocate.sleep_level=2"], "cluster.colocate.sleep_level=2 on CPU: vLLM's CPU worker ignores"),
    ([COLO, "rollout.staleness=1", "algorithm.rollout_is=tis"],
     "cluster.placement=colocated with rollout.staleness=1: colocated engines sleep while the trainer steps"),
    ([COLO, "cluster.gpus_per_node=1", "cluster.colocate.sleep_level=2", "model.lora.rank=8",
      "weight_sync.lora_mode=adapter", "weight_sync.transport=disk"],
     "cluster.colocate.sleep_level=2 discards the engines' weights, but weight_sync.lora_mode=adapter"),
    # on GPUs the sync must reach engines on the trainer's own GPUs: NCCL refuses two ranks of a group on
    # one GPU, and a CUDA IPC handle maps only on its own GPU
    ([COLO, "cluster.gpus_per_node=1"],
     "weight_sync.transport=broadcast with cluster.placement=colocated on GPUs: the broadcast group would hold"),
    ([COLO, "cluster.gpus_per_node=2", "rollout.num_engines=2", "weight_sync.transport=cuda_ipc"],
     "weight_sync.transport=cuda_ipc with rollout.num_engines x engine_tp = 2 engine GPU(s) and parallel.pp=1"),
    ([COLO, "cluster.gpus_per_node=2", "parallel.pp=2", "weight_sync.transport=cuda_ipc"],
     "= 1 engine GPU(s) and parallel.pp=2: one trainer rank per pipeline stage"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(b[0][-2:]) for b in BAD])
def test_bad_colocate_config_names_the_field(overrides, message):
    with pytest.raises(ConfigError) as ei:
        validate(load_config(DEFAULT, overrides), has_cuda=True)
    assert message in str(ei.value)
    assert "\n" not in str(ei.value)


def test_colocated_cpu_run_validates():
    cfg = load_config(DEFAULT, [COLO, "cluster.colocate.offload_params=true"])
    layout = validate(cfg, has_cuda=False)
    assert layout.trainer_devices == 1 and cfg.cluster.colocate.sleep_level == 1


def test_colocated_gpu_level_2_validates():
    cfg = load_config(DEFAULT, [COLO, "cluster.gpus_per_node=2", "cluster.colocate.sleep_level=2",
                                "weight_sync.transport=cuda_ipc"])
    layout = validate(cfg, has_cuda=True)
    assert layout.trainer_devices == 2  # colocated: every GPU trains and serves


def test_colocated_gpu_transports_that_reach_the_engines_validate():
    for overrides in (["cluster.gpus_per_node=4", "rollout.num_engines=2", "weight_sync.transport=disk"],
                      ["cluster.gpus_per_node=1", "weight_sync.transport=cuda_ipc"]):
        validate(load_config(DEFAULT, [COLO, *overrides]), has_cuda=True)
    # Ray clusters simulated on CPU (gloo between the ranks, no NCCL): broadcast works there
    validate(load_config(DEFAULT, [COLO, "cluster.nodes=2", "cluster.gpus_per_node=1"]), has_cuda=False)


@pytest.mark.parametrize("placement,restarts", [("disaggregated", 3), ("colocated", 0)])
def test_colocated_engines_are_not_restarted(tmp_path, placement, restarts):
    """A restarted colocated engine would hold its memory while the trainer steps, and its refresh
    would read the trainer's offloaded parameters (freed storage: a segfault on CPU)."""
    from types import SimpleNamespace

    from mlrl.jobs.rl_start import policy_pool
    from mlrl.modelzoo import resolve_model_dir

    cfg = load_config(DEFAULT, [f"cluster.placement={placement}"])
    pool = policy_pool(cfg, SimpleNamespace(engine_devices=None, engine_server=None),
                       resolve_model_dir(cfg.model.hf_dir), tmp_path)
    assert pool.max_restarts == restarts

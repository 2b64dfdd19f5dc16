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

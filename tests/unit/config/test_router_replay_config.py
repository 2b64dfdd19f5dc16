"""algorithm.router_replay: refused, naming the field, where it cannot be faithful."""

from pathlib import Path

import pytest

from mlrl.config import ConfigError, load_config, validate

DEFAULT = Path(__file__).resolve().parents[3] / "launch" / "cpu_default.yaml"
RR, MOE = "algorithm.router_replay=true", "model.hf_dir=builtin:tiny-qwen3-moe"

BAD = [
    ([RR], "algorithm.router_replay=true needs an MoE model; model.hf_dir (builtin:tiny-llama, "
     "model_type='llama') has no experts"),
    ([RR, MOE, "parallel.pp=2", "cluster.trainer_devices=2", "trainer.recompute=full"],
     "algorithm.router_replay=true with trainer.recompute=full: the recomputed forward"),
    ([RR, MOE, "trainer.recompute=full"], "algorithm.router_replay=true with trainer.recompute=full"),  # pp=1 too
    ([RR, MOE, "model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]", "weight_sync.lora_mode=adapter",
      "weight_sync.transport=disk"],
     "algorithm.router_replay=true: weight_sync.lora_mode=adapter"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=["dense", "recompute_pp", "recompute", "lora_adapter"])
def test_router_replay_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError) as ei:
        validate(load_config(DEFAULT, overrides), has_cuda=False)
    assert message in str(ei.value)


def test_router_replay_on_moe_validates():
    validate(load_config(DEFAULT, [RR, MOE, "parallel.ep=2", "cluster.trainer_devices=2"]), has_cuda=False)

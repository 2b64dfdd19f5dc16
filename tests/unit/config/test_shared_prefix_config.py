"""trainer.shared_prefix_packing: `always` refused, naming the field, where it cannot run; `auto`
resolved to exactly the runs that support it."""

from pathlib import Path

import pytest

from mlrl.config import ConfigError, load_config, validate

LAUNCH = Path(__file__).resolve().parents[3] / "launch"
ON = "trainer.shared_prefix_packing=always"
MOE_REPLAY = ["model.hf_dir=builtin:tiny-qwen3-moe", "algorithm.router_replay=true"]


@pytest.mark.parametrize("recipe,overrides,message", [
    ("cpu_default.yaml", [ON, "cluster.gpus_per_node=8"],
     "trainer.shared_prefix_packing=always with cluster.gpus_per_node=8"),
    ("cpu_default.yaml", [ON, *MOE_REPLAY], "trainer.shared_prefix_packing=always with algorithm.router_replay=true"),
    ("sft_cpu.yaml", [ON], "trainer.shared_prefix_packing=always: an RL setting"),
], ids=["gpu", "router_replay", "sft"])
def test_shared_prefix_packing_on_refused_naming_the_field(recipe, overrides, message):
    with pytest.raises(ConfigError) as ei:
        validate(load_config(LAUNCH / recipe, overrides), has_cuda="gpus_per_node=8" in " ".join(overrides))
    assert message in str(ei.value)


@pytest.mark.parametrize("overrides,used", [
    ([], True),  # the CPU demo's recipe says auto
    (["trainer.shared_prefix_packing=never"], False),
    ([ON], True),
    (["cluster.gpus_per_node=8"], False),  # Transformer Engine attention: auto leaves it off
    (MOE_REPLAY, False),
], ids=["auto_cpu", "never", "always", "auto_gpu", "auto_router_replay"])
def test_auto_packs_shared_prefixes_where_they_are_supported(overrides, used):
    cfg = load_config(LAUNCH / "cpu_default.yaml", overrides)
    validate(cfg, has_cuda="gpus_per_node=8" in " ".join(overrides))
    assert cfg.uses_shared_prefix_packing is used


def test_auto_in_an_sft_run_is_off():
    cfg = load_config(LAUNCH / "sft_cpu.yaml", ["trainer.shared_prefix_packing=auto"])
    validate(cfg, has_cuda=False)
    assert not cfg.uses_shared_prefix_packing

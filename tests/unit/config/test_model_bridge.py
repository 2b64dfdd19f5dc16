"""model.bridge=auto|builtin|megatron-bridge: resolution per model, and what validation refuses, by
name. megatron-bridge cannot be installed on these machines (Python 3.11, no CUDA); its presence is
simulated by patching the metadata lookup (the only thing resolution reads)."""

import json
from pathlib import Path

import pytest

from mlrl.bridge import BridgeError
from mlrl.bridge import select as sel
from mlrl.config import ConfigError, load_config, validate
from mlrl.modelzoo import hf_config_dict

DEFAULT = Path(__file__).resolve().parents[3] / "launch" / "cpu_default.yaml"


@pytest.fixture
def gemma(tmp_path):
    """An architecture outside the built-in bridge (config.json is all validation reads)."""
    cfg = dict(hf_config_dict("builtin:tiny-llama"), model_type="gemma2", architectures=["Gemma2ForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.setattr(sel, "megatron_bridge_version", lambda: "0.6.0")


def test_megatron_bridge_is_not_installed_here():
    assert sel.megatron_bridge_version() is None


def test_builtin_models_resolve_to_the_builtin_bridge_under_auto_and_builtin():
    hf = hf_config_dict("builtin:tiny-qwen3-yarn")
    assert sel.resolve_bridge("auto", hf) == "builtin"
    assert sel.resolve_bridge("builtin", hf) == "builtin"


def test_asking_for_megatron_bridge_without_it_names_the_package():
    with pytest.raises(BridgeError, match="model.bridge=megatron-bridge: megatron-bridge is not installed "
                                          r"\(package 'megatron-bridge', module megatron.bridge\)"):
        sel.resolve_bridge("megatron-bridge", hf_config_dict("builtin:tiny-llama"))
    with pytest.raises(ConfigError, match="megatron-bridge is not installed"):
        validate(load_config(DEFAULT, ["model.bridge=megatron-bridge"]), has_cuda=True)


def test_an_unsupported_architecture_names_the_supported_ones_and_the_way_out(gemma):
    expected = ("model.bridge=auto: config.json: model_type .gemma2. is not supported; supported: llama, mistral, "
                "qwen2, qwen3, qwen3_moe; megatron-bridge")
    with pytest.raises(ConfigError, match=expected):
        validate(load_config(DEFAULT, [f"model.hf_dir={gemma}"]), has_cuda=True)
    with pytest.raises(BridgeError) as ei:
        sel.resolve_bridge("builtin", json.loads((gemma / "config.json").read_text()))
    assert "megatron-bridge" not in str(ei.value)  # builtin was asked for: no hint about the other bridge


def test_an_unsupported_rope_type_is_caught_by_validation(tmp_path):
    cfg = dict(hf_config_dict("builtin:tiny-llama"), rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="rope type 'dynamic'.*supported rope types: default, linear, llama3, yarn"):
        validate(load_config(DEFAULT, [f"model.hf_dir={tmp_path}"]), has_cuda=True)


def test_auto_falls_through_to_megatron_bridge_when_installed(gemma, installed):
    hf = json.loads((gemma / "config.json").read_text())
    assert sel.resolve_bridge("auto", hf) == "megatron-bridge"
    assert sel.resolve_bridge("builtin", {**hf, "model_type": "llama"}) == "builtin"
    with pytest.raises(BridgeError, match="model_type 'gemma2' is not supported"):
        sel.resolve_bridge("builtin", hf)
    # explicitly asked for, megatron-bridge takes even a model the built-in bridge supports
    assert sel.resolve_bridge("megatron-bridge", hf_config_dict("builtin:tiny-llama")) == "megatron-bridge"


@pytest.mark.parametrize("overrides,message", [
    ([], "needs CUDA and Transformer Engine"),
    (["cluster.gpus_per_node=2", "model.lora.rank=8"], "model.lora is not supported with megatron-bridge"),
    (["cluster.gpus_per_node=2", "algorithm.advantage=gae"], "critic is not supported with megatron-bridge"),
])
def test_megatron_bridge_path_refuses_what_it_cannot_carry(gemma, installed, overrides, message):
    cfg = load_config(DEFAULT, [f"model.hf_dir={gemma}", *overrides])
    with pytest.raises(ConfigError, match=message):
        validate(cfg, has_cuda="needs CUDA" not in message)


def test_dry_run_plans_for_megatron_bridge_without_it_installed(gemma):
    cfg = load_config(DEFAULT, [f"model.hf_dir={gemma}", "model.bridge=megatron-bridge", "cluster.gpus_per_node=8"])
    validate(cfg, dry_run=True)


def test_bad_bridge_value_is_named():
    with pytest.raises(BridgeError, match="model.bridge='hf': expected one of auto, builtin, megatron-bridge"):
        sel.resolve_bridge("hf", hf_config_dict("builtin:tiny-llama"))
    with pytest.raises(ConfigError, match="model.bridge"):
        load_config(DEFAULT, ["model.bridge=hf"])

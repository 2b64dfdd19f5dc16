"""trainer.deterministic and model.dtype=float32 on the GPU branch, driven on CPU by patching the
device probe: what each rank sets (env for TE / cuBLAS, torch flags), what megatron-core's
TransformerConfig receives, what the driver puts into the ranks' environment, and the
validation errors (CUDA without Transformer Engine; deterministic=false on CPU)."""

import os

import pytest
import torch

from mlrl.bridge import spec_for
from mlrl.config.loader import ConfigError
from mlrl.config.schema import Config
from mlrl.config.validate import resolve_layout, validate
from mlrl.modelzoo import hf_config_dict
from mlrl.trainer.driver.group import rank_env as driver_rank_env
from mlrl.trainer.rank import model as model_mod
from mlrl.trainer.rank import numerics


def _cfg(dtype="float32", deterministic="auto", gpus=0):
    cfg = Config()
    cfg.model.dtype, cfg.trainer.deterministic, cfg.cluster.gpus_per_node = dtype, deterministic, gpus
    cfg.data.max_prompt_tokens = 128  # the default model's 256 positions
    return cfg


def test_auto_is_exact_on_cpu_and_fast_on_gpu():
    assert numerics.deterministic("auto", gpu=False) is True
    assert numerics.deterministic("auto", gpu=True) is False
    assert numerics.deterministic(True, gpu=True) is True and numerics.deterministic(False, gpu=True) is False


@pytest.mark.parametrize("dtype,det,want", [
    ("bfloat16", "auto", {}),
    ("bfloat16", True, {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    ("float32", "auto", {"NVIDIA_TF32_OVERRIDE": "0"}),
    ("float32", True, {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                       "NVIDIA_TF32_OVERRIDE": "0"}),
])
def test_rank_env_on_gpu(dtype, det, want):
    c = _cfg(dtype, det, gpus=1)
    assert numerics.rank_env(c.model, c.trainer, gpu=True) == want
    assert numerics.rank_env(c.model, c.trainer, gpu=False) == {}  # CPU ranks: nothing to set
    # the driver hands the same variables to every rank it spawns, on top of the placement's
    assert driver_rank_env(c, {"CUDA_VISIBLE_DEVICES": "3"}) == {"CUDA_VISIBLE_DEVICES": "3", **want}
    c.cluster.gpus_per_node = 0
    assert driver_rank_env(c, {"X": "1"}) == {"X": "1"}


@pytest.fixture
def restore_torch_numerics(monkeypatch):
    for k in ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE"):
        monkeypatch.delenv(k, raising=False)
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic,
     torch.backends.cudnn.benchmark) = saved[:4]
    torch.use_deterministic_algorithms(saved[4], warn_only=saved[5])


def test_configure_on_gpu_sets_env_and_torch_flags(monkeypatch, restore_torch_numerics):
    monkeypatch.setattr(numerics, "transformer_engine_installed", lambda: True)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    c = _cfg("float32", True, gpus=1)
    applied = numerics.configure(c.model, c.trainer, gpu=True)
    assert applied["deterministic"] and applied["tf32"] is False
    assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0" and os.environ["NVIDIA_TF32_OVERRIDE"] == "0"
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic


def test_configure_bf16_auto_on_gpu_leaves_kernels_free(monkeypatch, restore_torch_numerics):
    monkeypatch.setattr(numerics, "transformer_engine_installed", lambda: True)
    torch.use_deterministic_algorithms(False)
    torch.backends.cuda.matmul.allow_tf32 = True
    c = _cfg("bfloat16", "auto", gpus=1)
    applied = numerics.configure(c.model, c.trainer, gpu=True)
    assert applied == {"deterministic": False, "gpu": True, "env": {}}
    assert "NVTE_ALLOW_NONDETERMINISTIC_ALGO" not in os.environ and "NVIDIA_TF32_OVERRIDE" not in os.environ
    assert torch.backends.cuda.matmul.allow_tf32 and not torch.are_deterministic_algorithms_enabled()


def test_configure_on_cpu_changes_nothing(restore_torch_numerics):
    c = _cfg("float32", True)
    assert numerics.configure(c.model, c.trainer, gpu=False) == {"deterministic": True, "gpu": False}
    assert "NVIDIA_TF32_OVERRIDE" not in os.environ and not torch.are_deterministic_algorithms_enabled()


def test_a_gpu_rank_without_transformer_engine_fails_before_building(monkeypatch):
    monkeypatch.setattr(numerics, "transformer_engine_installed", lambda: False)
    c = _cfg("bfloat16", "auto", gpus=1)
    with pytest.raises(RuntimeError, match="Transformer Engine is not installed: pip install"):
        numerics.configure(c.model, c.trainer, gpu=True)


@pytest.mark.parametrize("det,mode", [("auto", False), (True, True), (False, False)])
def test_transformer_config_deterministic_mode_on_gpu(monkeypatch, det, mode):
    monkeypatch.setattr(model_mod, "use_te", lambda: True)
    c = _cfg("bfloat16", det, gpus=2)
    _, arch = spec_for(hf_config_dict("builtin:tiny-llama"))
    fields = model_mod.layout_fields(arch, c.model, c.parallel, c.trainer, resolve_layout(c))
    assert fields.get("deterministic_mode", False) is mode


def test_transformer_config_on_cpu_never_asks_for_te_determinism():
    c = _cfg("float32", True)
    _, arch = spec_for(hf_config_dict("builtin:tiny-llama"))
    assert "deterministic_mode" not in model_mod.layout_fields(arch, c.model, c.parallel, c.trainer, resolve_layout(c))


def test_validation_refuses_cuda_without_transformer_engine():
    c = _cfg("bfloat16", "auto", gpus=2)
    c.rollout.num_engines = 1
    with pytest.raises(ConfigError, match="this machine has CUDA but not Transformer Engine.*transformer_engine"):
        validate(c, has_cuda=True, has_te=False)
    validate(c, has_cuda=True, has_te=True)  # the same config on a machine with TE is fine


def test_validation_refuses_deterministic_false_on_cpu():
    c = _cfg("float32", False)
    with pytest.raises(ConfigError, match="trainer.deterministic=false: the CPU trainer is always deterministic"):
        validate(c, has_cuda=False)
    c.trainer.deterministic = "auto"
    validate(c, has_cuda=False)


def test_moe_layout_fields_turn_the_load_balancing_loss_off_on_both_paths():
    """The megatron-bridge path sets these fields over its provider, which would otherwise keep the
    HF config's router aux-loss coefficient: under calculate_per_token_loss megatron weighs that
    loss once per micro-batch and DDP sums it over DP, so it would grow with the split."""
    c = _cfg("float32", True)
    _, moe = spec_for(hf_config_dict("builtin:tiny-qwen3-moe"))
    f = model_mod.layout_fields(moe, c.model, c.parallel, c.trainer, resolve_layout(c))
    assert (f["moe_router_load_balancing_type"], f["moe_aux_loss_coeff"]) == ("none", 0.0)
    _, dense = spec_for(hf_config_dict("builtin:tiny-llama"))
    assert "moe_aux_loss_coeff" not in model_mod.layout_fields(dense, c.model, c.parallel, c.trainer,
                                                               resolve_layout(c))

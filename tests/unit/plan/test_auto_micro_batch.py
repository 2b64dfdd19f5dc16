"""trainer.micro_batch_tokens=auto: sized by the memory plan before any process starts.

The GPU branch runs here from the plan alone (a preset's config.json, no GPU): after validate(),
resolve_micro_batch_tokens (what mlrl.launch calls) turns `auto` into a number, and that number
is the largest step of AUTO_TOKEN_STEP tokens whose plan keeps the fullest trainer GPU within
AUTO_MEMORY_FRACTION of cluster.gpu_memory_gb, inside the bounds the field's docstring names.
"""

import dataclasses
from pathlib import Path

import pytest

from mlrl.config import ConfigError, load_config, validate
from mlrl.plan import make_plan
from mlrl.plan import memory as mem
from mlrl.plan.planner import (
    AUTO_MEMORY_FRACTION,
    AUTO_TOKEN_STEP,
    CPU_MICRO_BATCH_TOKENS,
    auto_micro_batch_tokens,
    resolve_micro_batch_tokens,
    trainer_train_bytes,
)

ROOT = Path(__file__).resolve().parents[3]
QWEN8B = ROOT / "launch" / "qwen3_8b_grpo.yaml"
# one node of 8 GPUs: 4 trainer GPUs (tp 2, dp 2) and 2 engines of engine_tp 2
NODE = ("model.hf_dir=/nonexistent", "cluster.nodes=1", "cluster.gpus_per_node=8", "cluster.trainer_devices=4",
        "rollout.num_engines=2")


def resolved(recipe, *overrides):
    cfg = load_config(recipe, ["trainer.micro_batch_tokens=auto", *overrides])
    layout = validate(cfg, dry_run=True)
    resolve_micro_batch_tokens(cfg, layout)
    return cfg, layout


def peak_with(cfg, layout, tokens):
    trial = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, micro_batch_tokens=tokens))
    return trainer_train_bytes(make_plan(trial, layout))


def test_cpu_auto_is_the_cpu_recipes_value():
    cfg, _ = resolved(ROOT / "launch" / "cpu_default.yaml")
    assert cfg.trainer.micro_batch_tokens == CPU_MICRO_BATCH_TOKENS == 4096


@pytest.mark.parametrize("gb", [141.0, 192.0])
def test_gpu_auto_is_the_largest_step_that_fits(gb):
    cfg, layout = resolved(QWEN8B, *NODE, f"cluster.gpu_memory_gb={gb}")
    n = cfg.trainer.micro_batch_tokens
    assert isinstance(n, int) and n % AUTO_TOKEN_STEP == 0
    budget = AUTO_MEMORY_FRACTION * gb * mem.GIB
    # fits, and one step more does not (the step's own cap is far above: 64 x 16 x 9216 / 1 tokens)
    assert peak_with(cfg, layout, n) <= budget < peak_with(cfg, layout, n + AUTO_TOKEN_STEP)
    assert make_plan(cfg, layout).fits


def test_more_memory_gives_a_larger_budget_and_recompute_a_larger_one_still():
    small, _ = resolved(QWEN8B, *NODE, "cluster.gpu_memory_gb=141")
    big, _ = resolved(QWEN8B, *NODE, "cluster.gpu_memory_gb=192")
    full, _ = resolved(QWEN8B, *NODE, "cluster.gpu_memory_gb=141", "trainer.recompute=full")
    assert big.trainer.micro_batch_tokens > small.trainer.micro_batch_tokens
    assert full.trainer.micro_batch_tokens > small.trainer.micro_batch_tokens  # full recompute keeps less per token


def test_auto_changes_the_plan_against_the_recipe_value():
    fixed = load_config(QWEN8B, list(NODE) + ["cluster.gpu_memory_gb=141"])
    plan_fixed = make_plan(fixed, validate(fixed, dry_run=True))
    cfg, layout = resolved(QWEN8B, *NODE, "cluster.gpu_memory_gb=141")
    plan_auto = make_plan(cfg, layout)
    assert cfg.trainer.micro_batch_tokens > fixed.trainer.micro_batch_tokens == 16384
    assert plan_auto.micro_batches < plan_fixed.micro_batches


def test_capped_by_a_ranks_step_and_by_the_pipeline():
    # 4 prompts x 2 samples x (1024 + 1024) tokens = 16384 tokens a step, 8192 per DP rank (dp 2)
    few = ("trainer.prompts_per_step=4", "trainer.samples_per_prompt=2", "trainer.mini_batches_per_step=1",
           "rollout.sampling.max_new_tokens=1024", "algorithm.overlong_buffer=256", "rollout.max_model_len=2048",
           "cluster.gpu_memory_gb=141")
    cfg, layout = resolved(QWEN8B, *NODE, *few)
    assert layout.dp == 2 and cfg.trainer.micro_batch_tokens == 8192
    # tp 2 x pp 2 on the same 4 GPUs: dp 1, 16384 tokens per rank, but at least 2 micro-batches
    cfg, layout = resolved(QWEN8B, *NODE, *few, "parallel.pp=2")
    assert (layout.pp, layout.dp) == (2, 1)
    assert cfg.trainer.micro_batch_tokens == 8192
    assert make_plan(cfg, layout).micro_batches == 2


def test_nothing_fits_gives_one_whole_sequence_and_the_plan_says_why():
    cfg, layout = resolved(QWEN8B, *NODE, "cluster.gpu_memory_gb=24")
    seq = 1024 + 8192
    assert cfg.trainer.micro_batch_tokens == -(-seq // AUTO_TOKEN_STEP) * AUTO_TOKEN_STEP
    assert not make_plan(cfg, layout).fits


COLOCATED = ("model.hf_dir=/nonexistent", "cluster.nodes=1", "cluster.gpus_per_node=4", "cluster.placement=colocated",
             "rollout.num_engines=2", "cluster.gpu_memory_gb=141", "weight_sync.transport=disk")


def test_colocated_sizes_the_training_phase_and_leaves_room_for_the_sleeping_engine():
    apart, _ = resolved(QWEN8B, *NODE, "cluster.gpu_memory_gb=141")
    # the default rollout.gpu_memory_utilization (0.85): the rollout phase alone is over 85% of the
    # GPU whatever the micro-batch, so only the training phase (which grows with it) is sized
    co, layout = resolved(QWEN8B, *COLOCATED)
    assert layout.dp == 2 and co.rollout.gpu_memory_utilization == 0.85
    seq = 1024 + 8192
    assert co.trainer.micro_batch_tokens > -(-seq // AUTO_TOKEN_STEP) * AUTO_TOKEN_STEP  # not the floor
    assert co.trainer.micro_batch_tokens < apart.trainer.micro_batch_tokens  # the sleeping engine's runtime
    budget = AUTO_MEMORY_FRACTION * 141 * mem.GIB
    n = co.trainer.micro_batch_tokens
    assert peak_with(co, layout, n) <= budget < peak_with(co, layout, n + AUTO_TOKEN_STEP)
    slot = next(s for s in make_plan(co, layout).slots if s.trainer is not None)
    assert make_plan(co, layout).slot_phases(slot).rollout.total > budget  # the phase auto leaves alone


def test_the_local_gpu_caps_the_configured_memory(monkeypatch):
    import sys
    import types

    from mlrl.launch import local_gpu_gib

    big, layout = resolved(QWEN8B, *NODE, "cluster.gpu_memory_gb=192")
    small = load_config(QWEN8B, ["trainer.micro_batch_tokens=auto", *NODE, "cluster.gpu_memory_gb=192"])
    resolve_micro_batch_tokens(small, validate(small, dry_run=True), device_gb=141.0)
    same, _ = resolved(QWEN8B, *NODE, "cluster.gpu_memory_gb=141")
    assert small.trainer.micro_batch_tokens == same.trainer.micro_batch_tokens < big.trainer.micro_batch_tokens
    # NVML's smallest device, in GiB; no NVML: None
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=(80 if h else 141) * 2**30))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert local_gpu_gib() == 80.0
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert local_gpu_gib() is None


def test_a_multi_turn_trajectory_up_to_max_model_len_is_the_floor():
    cfg, layout = resolved(QWEN8B, *NODE, "cluster.gpu_memory_gb=24", "rollout.max_model_len=12288")
    assert cfg.trainer.micro_batch_tokens == 12288
    cpu, _ = resolved(ROOT / "launch" / "cpu_default.yaml", "rollout.max_model_len=8192", "model.hf_dir=/nonexistent",
                      "model.arch=Qwen/Qwen3-8B")
    assert cpu.trainer.micro_batch_tokens == 8192


def test_dpo_auto_holds_a_whole_pair():
    cfg, _ = resolved(ROOT / "launch" / "dpo_cpu.yaml", "cluster.gpus_per_node=1", "dpo.max_seq_tokens=3000",
                      "cluster.gpu_memory_gb=80")
    assert cfg.trainer.micro_batch_tokens >= 6000


def test_print_config_shows_the_resolved_number(capsys):
    from mlrl.launch import main

    assert main(["--print-config", "trainer.micro_batch_tokens=auto"]) == 0
    assert "micro_batch_tokens: 4096" in capsys.readouterr().out


@pytest.mark.parametrize("value,words", [("big", "trainer.micro_batch_tokens: got 'big'"),
                                         ("0", "trainer.micro_batch_tokens: got 0, expected >= 1")])
def test_bad_values_name_the_field(value, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        cfg = load_config(ROOT / "launch" / "cpu_default.yaml", [f"trainer.micro_batch_tokens={value}"])
        validate(cfg)


def test_unresolved_auto_is_not_a_number():
    cfg = load_config(ROOT / "launch" / "cpu_default.yaml", ["trainer.micro_batch_tokens=auto"])
    with pytest.raises(RuntimeError, match="micro_batch_tokens=auto is unresolved"):
        _ = cfg.trainer.token_budget
    assert auto_micro_batch_tokens(cfg, validate(cfg)) == 4096


def test_cpu_auto_holds_one_whole_conversation():
    cfg = load_config(ROOT / "launch" / "sft_cpu.yaml", ["trainer.micro_batch_tokens=auto", "sft.max_seq_tokens=8000",
                                                         "model.hf_dir=/nonexistent", "model.arch=Qwen/Qwen3-8B"])
    resolve_micro_batch_tokens(cfg, validate(cfg, dry_run=True))
    assert cfg.trainer.micro_batch_tokens == 8192  # 4096 would refuse the conversation

"""Config loading, overrides and validation: each bad config fails with its own one-line message."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.launching import launch_refused

from mlrl.config import (
    ConfigError,
    CriticConfig,
    OptimizerConfig,
    TrainerConfig,
    config_from_yaml,
    dump_yaml,
    load_config,
    resolve_layout,
    validate,
)
from mlrl.config.loader import REMOVED

ROOT = Path(__file__).resolve().parents[3]
DEFAULT = ROOT / "launch" / "cpu_default.yaml"
GPU8 = ["cluster.gpus_per_node=8", "rollout.num_engines=2"]  # one node of 8 GPUs (validated with has_cuda=True)


def test_defaults_and_overrides_types():
    cfg = load_config(DEFAULT, ["trainer.lr=3e-4", "parallel.tp=2", "rollout.sampling.top_p=0.9", "data.eval=null"])
    assert cfg.trainer.lr == pytest.approx(3e-4) and isinstance(cfg.trainer.lr, float)
    assert cfg.parallel.tp == 2 and cfg.rollout.sampling.top_p == 0.9 and cfg.data.eval is None
    assert "lr: 0.0003" in dump_yaml(cfg)


def test_numbers_are_yaml_1_2_and_override_text_is_taken_as_written(tmp_path):
    """YAML 1.1 read `1e-5` in a free-form field as a string (a workflow's `lr < x` then raised),
    `010` as octal 8 and `1:30` in base 60 (90); an override's ` #` started a comment and `a: b`
    made a mapping."""
    cfg = load_config(DEFAULT, ["workflow.kwargs.lr=1e-5", "workflow.kwargs.t=12:30", "workflow.kwargs.h=0x10",
                                "workflow.kwargs.note=Answer: briefly", "logging.run_dir=runs/a #1",
                                "workflow.kwargs.l=[1, 2]", "workflow.kwargs.d={a: 1.5e2}", "workflow.kwargs.q='x #y'",
                                "workflow.kwargs.tag=#v2", "workflow.kwargs.s='1e3'", "workflow.kwargs.o='0o17'",
                                "trainer.total_steps=1_000"])
    assert cfg.workflow.kwargs == {"lr": 1e-5, "t": "12:30", "h": 16, "note": "Answer: briefly", "l": [1, 2],
                                   "d": {"a": 150.0}, "q": "x #y", "tag": "#v2", "s": "1e3", "o": "0o17"}
    assert cfg.logging.run_dir == "runs/a #1" and cfg.trainer.total_steps == 1000
    # what the trainer ranks read back: strings the loader would take for numbers are quoted
    assert config_from_yaml(dump_yaml(cfg)) == cfg
    assert config_from_yaml(dump_yaml(load_config(DEFAULT, ["logging.run_dir='1e3'"]))).logging.run_dir == "1e3"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  lr: 5e-6\n  total_steps: 012\n")
    with pytest.raises(ConfigError, match="'012' on line 3 is ambiguous .YAML 1.1 reads a leading zero as octal"):
        load_config(recipe)
    recipe.write_text("trainer:\n  lr: 5e-6\n")
    assert load_config(recipe).trainer.lr == 5e-6


def test_default_recipe_validates():
    layout = validate(load_config(DEFAULT), has_cuda=False)
    assert layout.dp == 1 and layout.trainer_devices == 1


def test_dp_derived_from_trainer_devices():
    layout = validate(load_config(DEFAULT, ["cluster.trainer_devices=2"]), has_cuda=False)
    assert layout.dp == 2 and layout.trainer_devices == 2
    layout = validate(load_config(DEFAULT, ["cluster.trainer_devices=4", "parallel.pp=2"]), has_cuda=False)
    assert (layout.pp, layout.dp, layout.trainer_devices) == (2, 2, 4)
    # CPU without trainer_devices: tp*pp*cp ranks, dp = 1
    layout = validate(load_config(DEFAULT, ["parallel.pp=2"]), has_cuda=False)
    assert (layout.dp, layout.trainer_devices) == (1, 2)


@pytest.mark.parametrize("overrides,devices,dp", [
    (["cluster.gpus_per_node=8", "rollout.num_engines=2", "rollout.engine_tp=2", "parallel.tp=2"], 4, 2),
    (["cluster.gpus_per_node=8", "cluster.placement=colocated", "parallel.tp=2"], 8, 4),
    (["cluster.gpus_per_node=8", "cluster.trainer_devices=2", "parallel.tp=2"], 2, 1),
])
def test_gpu_trainer_devices_derived_from_the_cluster(overrides, devices, dp):
    layout = resolve_layout(load_config(DEFAULT, overrides))
    assert (layout.trainer_devices, layout.dp) == (devices, dp)


def test_precision_follows_model_dtype():
    assert [load_config(DEFAULT, [f"model.dtype={d}"]).model.precision for d in ("float32", "bfloat16", "float16")] \
        == ["fp32", "bf16", "fp16"]
    assert "precision" not in dump_yaml(load_config(DEFAULT))  # derived: not a config key


def test_optimizer_fields_declared_once_for_trainer_and_critic():
    shared = {f.name for f in dataclasses.fields(OptimizerConfig)}
    assert shared == {"lr", "min_lr", "lr_schedule", "weight_decay", "grad_clip", "lr_warmup_steps"}
    assert issubclass(TrainerConfig, OptimizerConfig) and issubclass(CriticConfig, OptimizerConfig)
    # same defaults and same YAML keys as before the fields were shared
    for cls in (TrainerConfig, CriticConfig):
        c = cls()
        assert (c.lr, c.min_lr, c.lr_schedule, c.weight_decay, c.grad_clip) == (1e-5, 0.0, "constant", 0.0, 1.0)
    cfg = load_config(DEFAULT, ["trainer.weight_decay=0.1", "critic.weight_decay=0.2", "critic.lr_schedule=cosine",
                                "critic.grad_clip=0.5", "trainer.min_lr=1e-7"])
    assert (cfg.trainer.weight_decay, cfg.critic.weight_decay, cfg.critic.lr_schedule) == (0.1, 0.2, "cosine")
    assert cfg.critic.lr == pytest.approx(2e-3) and cfg.trainer.lr == pytest.approx(4e-3)
    text = dump_yaml(cfg)
    assert "weight_decay: 0.1" in text and "weight_decay: 0.2" in text and "lr_warmup_steps: 0" in text
    assert config_from_yaml(text) == cfg  # inherited fields survive dump -> load (trainer ranks get the config so)
    with pytest.raises(
        ConfigError, match=r"critic.lr_schedule: got 'cosin', expected one of .* \(did you mean 'cosine"
    ):
        load_config(DEFAULT, ["critic.lr_schedule=cosin"])


REMOVED_NAMES = [
    ("trainer", "world_size", 4,
     "trainer.world_size was removed: set cluster.trainer_devices (the number of trainer ranks)"),
    ("parallel", "dp", 2,
     "parallel.dp was removed: the data-parallel size is derived as cluster.trainer_devices / (tp*pp*cp); "
     "set cluster.trainer_devices=N"),
    ("trainer", "precision", "bf16",
     "trainer.precision was removed: set model.dtype (float32|bfloat16|float16), the trainer's precision follows it"),
    ("trainer", "warmup_steps", 2,
     "trainer.warmup_steps was removed: renamed trainer.lr_warmup_steps (the linear LR warm-up, in optimizer "
     "updates; the same name as the critic's)"),
    ("critic", "warmup_steps", 1,
     "critic.warmup_steps was removed: renamed critic.critic_only_steps (the first RL steps that train only the "
     "critic); the critic's LR warm-up is critic.lr_warmup_steps"),
    ("rollout", "interrupt_on_update", "true",
     "rollout.interrupt_on_update was removed: renamed rollout.interrupt_on_sync (an update is an optimizer "
     "update; putting the weights into the engines is the weight sync)"),
]


@pytest.mark.parametrize("section,key,value,message", REMOVED_NAMES, ids=[f"{r[0]}.{r[1]}" for r in REMOVED_NAMES])
def test_removed_name_points_at_the_new_one(tmp_path, section, key, value, message):
    with pytest.raises(ConfigError) as ei:  # dotted override
        load_config(DEFAULT, [f"{section}.{key}={value}"])
    assert str(ei.value) == message
    recipe = tmp_path / "old.yaml"  # YAML recipe
    recipe.write_text(f"model: {{dtype: float32}}\n{section}:\n  {key}: {value}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(recipe)
    assert str(ei.value) == message
    assert set(REMOVED) == {f"{s}.{k}" for s, k, _, _ in REMOVED_NAMES} | {"mode"}
    # the CLI fails before anything starts, exit code 2, with the same message
    out = subprocess.run([sys.executable, "-m", "mlrl.launch", "--config", str(recipe), "--dry-run"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.strip() == f"config error: {message}", out.stderr


def test_removed_top_level_mode_points_at_staleness(tmp_path):
    message = ("mode was removed: asynchronous training is on exactly when rollout.staleness > 0 "
               "(set rollout.staleness=N for async, 0 for sync)")
    with pytest.raises(ConfigError) as ei:
        load_config(DEFAULT, ["mode=async", "rollout.staleness=1"])
    assert str(ei.value) == message
    recipe = tmp_path / "old.yaml"
    recipe.write_text("mode: sync\n")
    with pytest.raises(ConfigError) as ei:
        load_config(recipe)
    assert str(ei.value) == message
    # the fact it stood for is derived: async exactly when staleness > 0
    assert not load_config(DEFAULT).asynchronous
    assert load_config(DEFAULT, ["rollout.staleness=2", "algorithm.rollout_is=tis"]).asynchronous


BAD = [
    (["trainer.lrr=1"], "unknown config key 'trainer.lrr' (did you mean 'trainer.lr'?)"),
    (["trainr.lr=1"], "unknown config key 'trainr' (did you mean 'trainer'?)"),
    (["parallel.tp=two"], "parallel.tp: got 'two' (str), expected an integer"),
    (["parallel.vpp=x"], "parallel.vpp: got 'x' (str), expected an integer"),  # Optional[int]
    (["critic.value_clip=abc"], "critic.value_clip: got 'abc' (str), expected a number"),  # in Optional[CriticConfig]
    (["trainer.lr=-1"], "trainer.lr: got -1.0, expected > 0"),
    # nan passes every `x < 0` check; YAML 1.1's yes / off are not booleans here
    (["trainer.grad_clip=nan"], "trainer.grad_clip: got 'nan', expected a finite number"),
    (["trainer.lr=.inf"], "trainer.lr: got inf, expected a finite number"),
    (["trainer.deterministic=yes"], "override 'trainer.deterministic=yes': 'yes' on line 1 is ambiguous (YAML 1.1 "
     "reads it as a boolean): write true / false, or quote it for a string"),
    (["checkpoint.save_at_end=off"], "'off' on line 1 is ambiguous"),
    (["trainer.total_steps=010"], "'010' on line 1 is ambiguous (YAML 1.1 reads a leading zero as octal)"),
    (["trainer.total_steps=1:30"], "trainer.total_steps: got '1:30' (str), expected an integer"),  # not 90
    (["trainer.seed=99999999999999999999"], "trainer.seed: got 99999999999999999999, expected 0 <= seed < 2**63"),
    (["rollout.sampling.seed=-1"], "rollout.sampling.seed: got -1, expected 0 <= seed < 2**63"),
    (["workflow.kwargs={strict: no}"], "'no' on line 1 is ambiguous"),  # an untyped field: YAML 1.1 would say False
    (["trainer={lr: 1, lr: 2}"], "override 'trainer={lr: 1, lr: 2}': duplicate key 'lr' on line 1"),
    (["workflow.reward_timeout_s=0"], "workflow.reward_timeout_s: got 0.0, expected > 0 seconds"),
    (["workflow.episode_timeout_s=-1"], "workflow.episode_timeout_s: got -1.0, expected >= 0 seconds (0 = off)"),
    (["workflow.reward_workers=-2"], "workflow.reward_workers: got -2, expected >= 0"),
    (["checkpoint.hf_export_every=-1"], "checkpoint.hf_export_every: got -1, expected >= 0"),
    (["data.eval_every=-3"], "data.eval_every: got -3, expected >= 0"),
    (["rollout.max_model_len=-5"], "rollout.max_model_len: got -5, expected >= 1"),
    (["cluster.gpu_memory_gb=-80"], "cluster.gpu_memory_gb: got -80.0, expected > 0"),
    (["model.arch=bogus"], "model.arch: unknown preset 'bogus'; known: Qwen/Qwen3-8B"),
    (["model.arch=Qwen/Qwen3-8B"], "model.arch=Qwen/Qwen3-8B describes another model than model.hf_dir's "
     "config.json (model_type qwen3 vs llama, vocab_size 151936 vs 72"),
    (["workflow.reward=reward_model", "reward_model.hf_dir=/nope"],
     "reward_model.hf_dir: folder '/nope' does not exist"),
    (["rollout.sampling.top_p=1.5"], "rollout.sampling.top_p: got 1.5, expected in (0, 1]"),
    (
        ["cluster.trainer_devices=3", "parallel.tp=2"],
        "parallel: tp*pp*cp = 2*1*1 = 2 does not divide the trainer's 3 devices (cluster.trainer_devices); the "
        "data-parallel",
    ),
    (
        ["cluster.nodes=2", "cluster.gpus_per_node=4", "rollout.num_engines=3", "parallel.tp=2"],
        "does not divide the trainer's 5 devices (disaggregated: the GPUs left after the engines)",
    ),
    (["cluster.trainer_devices=0"], "cluster.trainer_devices: got 0, expected >= 1"),
    (["model.dtype=float16"], "model.dtype=float16 (trainer precision fp16) is GPU only"),
    (["model.dtype=fp16"], "model.dtype: got 'fp16', expected one of 'float32', 'bfloat16', 'float16'"),
    (["cluster.trainer_devices=3", "parallel.tp=3"], "parallel.tp=3 must divide the model's num_attention_heads=4"),
    (["cluster.trainer_devices=4", "parallel.tp=4"], "parallel.tp=4 must divide the model's num_key_value_heads=2"),
    (["cluster.trainer_devices=3", "parallel.pp=3"], "parallel.pp=3 must divide the model's num_hidden_layers=2"),
    (
        ["cluster.trainer_devices=2", "parallel.pp=2", "parallel.pp_layer_split=[1,2]"],
        "must be positive and sum to num_hidden_layers=2",
    ),
    (
        ["model.hf_dir=builtin:tiny-qwen3-moe", "cluster.trainer_devices=3", "parallel.ep=3"],
        "parallel.ep=3 must divide the model's num_experts=4",
    ),
    (["parallel.ep=2", "cluster.trainer_devices=2"], "parallel.ep=2 but the model"),
    (["trainer.fp8_recipe=delayed"], "trainer.fp8_recipe='delayed' needs GPUs"),
    (["trainer.fp8_recipe=fp4"], "trainer.fp8_recipe: got 'fp4', expected one of"),
    (["parallel.cp=2", "cluster.trainer_devices=2"], "parallel.cp=2: context parallel needs GPUs"),
    (["rollout.staleness=-1"], "rollout.staleness: got -1, expected >= 0"),
    (["rollout.staleness=1"], "needs importance-sampling correction"),
    (["model.hf_dir=/nonexistent/model"], "model.hf_dir: folder '/nonexistent/model' does not exist"),
    (["model.hf_dir=builtin:nope"], "unknown builtin model 'nope'"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel needs parallel.tp >= 2"),
    (["cluster.gpus_per_node=8"], "this machine has no CUDA device"),
    (["trainer.deterministic=maybe"], "trainer.deterministic: got 'maybe', expected true or false or 'auto'"),
    (["trainer.deterministic=false"], "trainer.deterministic=false: the CPU trainer is always deterministic"),
    (["rollout.sampling.max_new_tokens=1000"], "exceeds the model's max_position_embeddings=256"),
    (
        ["model.hf_dir=builtin:tiny-qwen3-moe", "cluster.trainer_devices=2", "parallel.tp=2"],
        "needs parallel.sequence_parallel=true",
    ),
    (["cluster.trainer_devices=2", "parallel.pp=2", "parallel.vpp=2"], "virtual pipeline stages are GPU only"),
    (["checkpoint.async_save=true"], "checkpoint.async_save needs GPUs"),
    (
        ["trainer.lr_warmup_steps=5", "trainer.total_steps=5"],
        "trainer.lr_warmup_steps=5 must be smaller than the optimizer updates",
    ),
    (
        ["trainer.lr_warmup_steps=10", "trainer.total_steps=5", "trainer.epochs_per_step=2"],
        "(trainer.total_steps * mini_batches_per_step * epochs_per_step = 10)",
    ),
    (["algorithm.advantage=gae", "critic.critic_only_steps=4", "trainer.total_steps=6", "trainer.lr_warmup_steps=2"],
     "trainer.lr_warmup_steps=2 must be smaller than the optimizer updates of the run (trainer.total_steps * "
     "mini_batches_per_step * epochs_per_step less the critic.critic_only_steps' = 2)"),
    (["algorithm.advantage=gae", "critic=null"], "algorithm.advantage=gae needs a critic: add a `critic:` section"),
    (["algorithm.advantage=gae", "critic.lr=0"], "critic.lr: got 0.0, expected > 0"),
    (["critic.lr=-1"], "critic.lr: got -1.0, expected > 0"),  # grpo carries the recipe's section: still checked
    (
        ["algorithm.advantage=gae", "critic.critic_only_steps=10", "trainer.total_steps=10"],
        "critic.critic_only_steps=10 (critic-only RL steps) must be smaller",
    ),
    (
        ["algorithm.advantage=gae", "critic.value_clip=-1"],
        "critic.grad_clip / weight_decay / value_clip: expected >= 0",
    ),
    (
        ["algorithm.advantage=gae", "critic.hf_dir=builtin:smollm2-135m-instruct"],
        "critic.hf_dir: vocab_size 49152 differs",
    ),
    (["algorithm.reference_hf_dir=/nonexistent/teacher"], "algorithm.reference_hf_dir: folder '/nonexistent/teacher' "
     "does not exist"),
    (["model.hf_dir=builtin:tiny-qwen3-moe", "algorithm.router_replay=true",
      "algorithm.reference_hf_dir=builtin:tiny-qwen3-moe"],
     "algorithm.reference_hf_dir with algorithm.router_replay=true: the engines' routes are the policy's experts"),
    (
        ["trainer.prompts_per_step=6", "trainer.mini_batches_per_step=4"],
        "trainer.mini_batches_per_step=4 must divide the prompt groups of a step",
    ),
    (["trainer.epochs_per_step=0"], "trainer.epochs_per_step: got 0, expected >= 1"),
    (["trainer.startup_timeout_s=0"], "trainer.startup_timeout_s=0.0: expected > 0 seconds"),
    (
        ["algorithm.rollout_is=icepop", "algorithm.icepop_low=2", "algorithm.icepop_high=0.5"],
        "algorithm.icepop_low / icepop_high: got [2.0, 0.5]",
    ),
    (["algorithm.rollout_is=icepop", "algorithm.icepop_low=0"], "algorithm.icepop_low / icepop_high: got [0.0, 5.0]"),
    (["eval.samples_per_prompt=0"], "eval.samples_per_prompt: got 0, expected >= 1"),
    (["algorithm.dynamic_sampling.max_rounds=0"], "algorithm.dynamic_sampling.max_rounds: got 0, expected >= 1"),
    (["algorithm.dynamic_sampling=true"], "algorithm.dynamic_sampling: expected a mapping of fields"),
    (
        ["algorithm.advantage=rloo", "algorithm.std_normalize=false"],
        "algorithm.std_normalize=false has no effect with algorithm.advantage='rloo'",
    ),
    (
        ["algorithm.use_rollout_logprobs=true", "algorithm.rollout_is=tis"],
        "algorithm.use_rollout_logprobs=true makes the behaviour logprobs",
    ),
    (
        ["cluster.nodes=2", "cluster.gpus_per_node=8", "cluster.join_timeout_s=0"],
        "cluster.join_timeout_s: got 0.0, expected > 0 (seconds)",
    ),
    (["cluster.nodes=2"], "cluster.nodes=2 needs cluster.gpus_per_node >= 1"),
    (["weight_sync.canary_every=0"], "weight_sync.canary_every"),
    (["weight_sync.canary_every=5", "weight_sync.canary_tolerance=0"],
     "weight_sync.canary_every=5 with the canary off (weight_sync.canary_tolerance <= 0)"),
    (
        ["cluster.nodes=2", "cluster.gpus_per_node=8", "cluster.placement=colocated", "weight_sync.transport=cuda_ipc"],
        "cluster.nodes=2 puts engines on other nodes: use weight_sync.transport=disk",
    ),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[b[0][0] for b in BAD])
def test_bad_config_fails_with_clear_message(overrides, message):
    with pytest.raises(ConfigError) as ei:
        validate(load_config(DEFAULT, overrides), has_cuda=False)
    assert message in str(ei.value)
    assert "\n" not in str(ei.value)


# (a field set where nothing reads it, the message, the same field where it acts): every knob either
# changes the run or is refused for its path (mlrl.config.validate._check_unused)
UNUSED = [
    (["algorithm.gamma=0.9"], "algorithm.gamma=0.9 has no effect with algorithm.advantage=grpo",
     ["algorithm.advantage=reinforce_pp"]),
    (["algorithm.lam=0.9"], "algorithm.lam=0.9 has no effect with algorithm.advantage=grpo",
     ["algorithm.advantage=gae"]),
    (["algorithm.dual_clip_c=4"], "algorithm.dual_clip_c=4.0 has no effect with algorithm.policy_loss=ppo",
     ["algorithm.policy_loss=dual_clip"]),
    (["algorithm.kl_coef=0", "algorithm.kl_estimator=k1"],
     "algorithm.kl_estimator='k1' has no effect with algorithm.kl_coef=0",
     ["algorithm.kl_coef=0.01"]),
    (["algorithm.kl_coef=0", "algorithm.kl_in_reward=true"],
     "algorithm.kl_in_reward=True has no effect with algorithm.kl_coef=0",
     ["algorithm.kl_coef=0.01"]),
    (["algorithm.kl_coef=0", "algorithm.reference_hf_dir=builtin:tiny-qwen3"],
     "algorithm.reference_hf_dir='builtin:tiny-qwen3' has no effect with algorithm.kl_coef=0",
     ["algorithm.kl_coef=0.01"]),
    (["algorithm.rollout_is_cap=3"], "algorithm.rollout_is_cap=3.0 has no effect with algorithm.rollout_is=none",
     ["algorithm.rollout_is=tis"]),
    (["algorithm.icepop_high=4"], "algorithm.icepop_high=4.0 has no effect with algorithm.rollout_is=none",
     ["algorithm.rollout_is=icepop"]),
    (["algorithm.overlong_penalty=0.5"], "algorithm.overlong_penalty=0.5 has no effect with "
     "algorithm.overlong_buffer=0", ["algorithm.overlong_buffer=8", "rollout.sampling.max_new_tokens=16"]),
    (["algorithm.dynamic_sampling.max_rounds=2"], "algorithm.dynamic_sampling.max_rounds=2 has no effect with "
     "algorithm.dynamic_sampling.enabled=false", ["algorithm.dynamic_sampling.enabled=true"]),
    (["rollout.stale_policy=reweight"], "rollout.stale_policy='reweight' has no effect with rollout.staleness=0",
     ["rollout.staleness=1", "algorithm.rollout_is=tis"]),
    (["rollout.interrupt_on_sync=true"], "rollout.interrupt_on_sync=True has no effect with rollout.staleness=0",
     ["rollout.staleness=1", "algorithm.rollout_is=tis"]),
    (["trainer.optimizer=sgd", "trainer.adam_beta2=0.95"], "trainer.adam_beta2=0.95 has no effect with "
     "trainer.optimizer=sgd", ["trainer.optimizer=adam"]),
    (["rollout.gpu_memory_utilization=0.5"], "rollout.gpu_memory_utilization=0.5 has no effect on CPU",
     [*GPU8]),
    (["cluster.gpu_memory_gb=40"], "cluster.gpu_memory_gb=40.0 has no effect on CPU", [*GPU8]),
    ([*GPU8, "rollout.cpu_kv_cache_gb=4"], "rollout.cpu_kv_cache_gb=4.0 has no effect on GPUs",
     ["cluster.gpus_per_node=0", "rollout.num_engines=1"]),
    (["cluster.ray_address=head:6379"], "cluster.ray_address='head:6379' has no effect with cluster.nodes=1",
     ["cluster.nodes=2", *GPU8]),
    (["cluster.nodes=2", *GPU8, "rollout.host=0.0.0.0"], "rollout.host='0.0.0.0' has no effect with cluster.nodes=2",
     ["cluster.nodes=1"]),
    (["weight_sync.disk_dir=/tmp/w"], "weight_sync.disk_dir='/tmp/w' has no effect with "
     "weight_sync.transport=broadcast", ["weight_sync.transport=disk"]),
    (["workflow.reward_timeout_s=5"], "workflow.reward_timeout_s=5.0 has no effect with workflow.reward=exact_match "
     "(an inline reward: called in the driver, with no process pool and no timeout)", ["workflow.reward=gsm8k"]),
    (["workflow.reward=token_match", "workflow.reward_workers=7"], "workflow.reward_workers=7 has no effect with "
     "workflow.reward=token_match",
     ["workflow.reward=math_verify"]),
    (["eval.samples_per_prompt=4"], "eval.samples_per_prompt=4 has no effect without data.eval",
     ["data.eval=synthetic:copy_digit", "data.eval_every=5"]),
]


def test_a_custom_workflow_may_read_the_reward_pool_settings_for_its_own_reward():
    """The inline-reward rule is the built-in workflows': a custom one is handed reward_timeout_s /
    reward_workers (when it declares them) whatever workflow.reward names."""
    validate(load_config(DEFAULT, ["workflow.name=my_pkg.MyWorkflow", "workflow.reward_workers=4"]), has_cuda=False)


@pytest.mark.parametrize("unused,message,live", UNUSED, ids=[u[1].split(" ")[0] for u in UNUSED])
def test_a_field_set_where_nothing_reads_it_is_refused(unused, message, live):
    with pytest.raises(ConfigError) as ei:
        validate(load_config(DEFAULT, unused), has_cuda=False)
    assert str(ei.value).startswith(message) and "remove it (default" in str(ei.value)
    validate(load_config(DEFAULT, [*unused, *live]), has_cuda=True)  # where it acts, it is taken


@pytest.mark.parametrize("overrides,message", [
    (["rollout.cpu_kv_cache_gb=1.5"], "rollout.cpu_kv_cache_gb=1.5: expected a whole number of GiB >= 1"),
    (["rollout.cpu_kv_cache_gb=0"], "rollout.cpu_kv_cache_gb=0.0: expected a whole number of GiB >= 1"),
    (["data.eval=synthetic:copy_digit"], "data.eval=synthetic:copy_digit is never evaluated with data.eval_every=0"),
])
def test_settings_that_would_silently_do_nothing_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config(DEFAULT, overrides), has_cuda=False)


LORA_VALID = "valid names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, all-linear"
MOE = "model.hf_dir=builtin:tiny-qwen3-moe"
BAD_LORA = [
    (
        ["model.lora.target_modules=[q_proj,foo]"],
        f"model.lora.target_modules: unknown target module 'foo'; {LORA_VALID}",
    ),
    (["model.lora.target_modules=[]"], f"model.lora.target_modules: an empty list; {LORA_VALID}"),
    (["model.lora.rank=0"], "model.lora.rank: got 0, expected > 0"),
    (["model.lora.rank=-8"], "model.lora.rank: got -8, expected > 0"),
    (["model.lora.alpha=0"], "model.lora.alpha: got 0.0, expected > 0"),
    (["model.lora.rank=16", "model.lora.alpha=-32"], "model.lora.alpha: got -32.0, expected > 0"),
    (["model.lora.dropout=1"], "model.lora.dropout: got 1.0, expected in [0, 1)"),
    (["model.lora.dropout=-0.1"], "model.lora.dropout: got -0.1, expected in [0, 1)"),
    (["weight_sync.lora_mode=adapter"], "weight_sync.lora_mode='adapter' needs model.lora (LoRA is off)"),
    (
        ["model.lora.rank=16", "weight_sync.lora_mode=adapter", "weight_sync.transport=broadcast"],
        "weight_sync.lora_mode=adapter hands the engines a PEFT adapter folder under weight_sync.disk_dir: set "
        "weight_sync.transport=disk (got 'broadcast')",
    ),
    (["checkpoint.export_merged=false"], "checkpoint.export_merged=false applies to LoRA runs only"),
    (  # all-linear on experts: every MLP target is named
        [MOE, "model.lora.rank=8"],
        "model.lora.target_modules: gate_proj, up_proj, down_proj on a MoE model (experts) is not supported yet",
    ),
    ([MOE, "model.lora.target_modules=[q_proj,down_proj]"], "model.lora.target_modules: down_proj on a MoE model"),
]


@pytest.mark.parametrize("overrides,message", BAD_LORA, ids=["-".join(b[0]) for b in BAD_LORA])
def test_bad_lora_config_fails_naming_the_field(overrides, message):
    with pytest.raises(ConfigError) as ei:
        validate(load_config(DEFAULT, overrides), has_cuda=False)
    assert message in str(ei.value)
    assert "\n" not in str(ei.value)


def test_lora_rank_override_turns_lora_on_with_defaults():
    assert load_config(DEFAULT).model.lora is None                        # off unless asked for
    cfg = load_config(DEFAULT, ["model.lora.rank=16"])
    lora = cfg.model.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (16, 32.0, 0.0, ["all-linear"])
    assert lora.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert lora.scaling == 2.0
    validate(cfg, has_cuda=False)
    assert config_from_yaml(dump_yaml(cfg)) == cfg                         # trainer ranks receive it so
    # the LoRA-only options are accepted once LoRA is on
    lora_only = ["checkpoint.export_merged=false", "weight_sync.lora_mode=adapter", "weight_sync.transport=disk"]
    validate(load_config(DEFAULT, ["model.lora.rank=16", *lora_only]), has_cuda=False)


def test_lora_on_moe_model_adapts_attention_only():
    cfg = load_config(DEFAULT, [MOE, "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"])
    validate(cfg, has_cuda=False)
    assert cfg.model.lora.targets == ("q_proj", "k_proj", "v_proj", "o_proj")


def test_cli_unknown_lora_target_exit_code():
    out = subprocess.run(
        [sys.executable, "-m", "mlrl.launch", "model.lora.target_modules=[q_proj,foo]", "--print-config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == f"config error: model.lora.target_modules: unknown target module 'foo'; {LORA_VALID}"


def test_missing_config_file_and_bad_override():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nope.yaml")
    with pytest.raises(ConfigError, match="must look like a.b=value"):
        load_config(DEFAULT, ["trainer.lr"])


def test_a_recipe_with_a_key_twice_or_a_folder_for_a_file_is_refused(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer: {lr: 3.0e-3, total_steps: 50}\nmodel: {dtype: float32}\ntrainer: {seed: 7}\n")
    with pytest.raises(ConfigError, match=re.escape(f"config file '{recipe}': duplicate key 'trainer' on line 3 "
                                                    "(first on line 1)")):
        load_config(recipe)
    with pytest.raises(ConfigError, match="is a directory, expected a YAML file"):
        load_config(tmp_path)
    # quoted, the words YAML 1.1 reads as booleans are strings; merge keys still merge (explicit keys win)
    assert load_config(DEFAULT, ["workflow.kwargs={style: 'on'}"]).workflow.kwargs == {"style": "on"}
    merged = tmp_path / "m.yaml"
    merged.write_text("trainer:\n  <<: {lr: 1.0e-5, seed: 3}\n  seed: 4\n")
    t = load_config(merged).trainer
    assert (t.lr, t.seed) == (1e-5, 4)


def test_missing_model_config_json(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        validate(load_config(DEFAULT, [f"model.hf_dir={tmp_path}"]), has_cuda=False)


def test_a_malformed_config_json_or_recipe_is_a_config_error(tmp_path):
    """A list for config.json, a string head count, a recipe that is not UTF-8: tracebacks before
    (AttributeError, TypeError, UnicodeDecodeError)."""
    cfg_json = tmp_path / "config.json"
    for text, message in (("[1, 2]", "must hold a JSON object, got list"),
                          ('{"num_attention_heads": "4", "num_hidden_layers": 2}',
                           "num_attention_heads is '4', expected a non-negative integer")):
        cfg_json.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(load_config(DEFAULT, [f"model.hf_dir={tmp_path}"]), has_cuda=False)
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(b"trainer: {lr: 1.0e-3}\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"r.yaml' is not UTF-8 text \(byte at offset 27\)"):
        load_config(recipe)


def _model_dir(path: Path, base: str = "builtin:tiny-llama", **fields) -> Path:
    """A model folder whose config.json is `base`'s with `fields` changed (validation reads no weights)."""
    from mlrl.modelzoo import hf_config_dict

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**hf_config_dict(base, None), **fields}))
    return path


@pytest.mark.parametrize("model,overrides,message", [
    # what each trainer rank's own layout check (mlrl.bridge.check_layout) would refuse at start, after
    # the engines were up: validation reaches it first
    ({"intermediate_size": 129}, ["cluster.trainer_devices=2", "parallel.tp=2"],
     "parallel.tp=2 must divide the model's intermediate_size=129"),
    (None, [*GPU8, "parallel.pp=2", "parallel.vpp=2", "parallel.pp_layer_split=[1,1]"],
     "parallel.pp_layer_split cannot be combined with parallel.vpp"),
    ({"base": "builtin:tiny-qwen3-moe", "moe_intermediate_size": 66},
     [*GPU8, "parallel.etp=4", "parallel.tp=2", "parallel.sequence_parallel=true"],
     "parallel.etp=4 must divide the model's moe_intermediate_size=66"),
    ({"model_type": "mistral", "sliding_window": 64, "architectures": ["MistralForCausalLM"]},
     [*GPU8, "parallel.cp=2"], "parallel.cp > 1 is not supported with sliding-window attention"),
])
def test_the_bridges_layout_rules_fail_at_validation(tmp_path, model, overrides, message):
    model_over = [] if model is None else [f"model.hf_dir={_model_dir(tmp_path / 'm', **model)}"]
    with pytest.raises(ConfigError) as ei:
        validate(load_config(DEFAULT, [*model_over, *overrides]), has_cuda=True)
    assert str(ei.value) == message
    # the critic's body is checked the same way
    if model is not None and "base" not in model:
        with pytest.raises(ConfigError, match=f"critic.hf_dir: {message}"):
            validate(load_config(DEFAULT, [*overrides, "algorithm.advantage=gae",
                                           f"critic.hf_dir={_model_dir(tmp_path / 'm', **model)}"]), has_cuda=True)
        # and so is a KL reference of its own (a teacher)
        with pytest.raises(ConfigError, match=f"algorithm.reference_hf_dir: {message}"):
            teacher = _model_dir(tmp_path / "m", **model)
            validate(load_config(DEFAULT, [*overrides, f"algorithm.reference_hf_dir={teacher}"]), has_cuda=True)


def test_print_config_cli():
    out = subprocess.run(
        [sys.executable, "-m", "mlrl.launch", "--config", str(DEFAULT), "trainer.lr=0.5", "--print-config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "lr: 0.5" in out.stdout and "hf_dir: builtin:tiny-llama" in out.stdout


def test_cli_bad_config_exit_code():
    out = subprocess.run(
        [sys.executable, "-m", "mlrl.launch", "parallel.tp=3", "cluster.trainer_devices=3", "--print-config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert "config error: parallel.tp=3 must divide" in out.stderr


def test_multi_node_run_without_a_ray_cluster_fails_clearly_before_starting_anything(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = launch_refused("--nodes", "2", "cluster.gpus_per_node=8", f"cluster.ray_address=127.0.0.1:{port}",
                         f"logging.run_dir={tmp_path}/run")
    assert out.returncode == 4, out.stderr[-2000:]
    assert f"cluster error: cluster.ray_address='127.0.0.1:{port}': nothing accepts connections there" in out.stderr
    assert not (tmp_path / "run" / "trainer.log").exists() and not (tmp_path / "run" / "engines").exists()


def test_derived_quantities_have_one_home_on_the_config():
    """The run's optimizer updates (both LR schedules and both warm-up checks count them) and the
    trainer's logprob temperature are each one property, not a formula repeated at each use."""
    from mlrl.config.schema import SamplingConfig, TrainerConfig

    assert TrainerConfig(total_steps=10).total_updates == 10
    assert TrainerConfig(total_steps=10, mini_batches_per_step=4, epochs_per_step=2).total_updates == 80
    assert SamplingConfig(temperature=0.7).logprob_temperature == 0.7
    assert SamplingConfig(temperature=0.0).logprob_temperature == 1.0  # greedy: the plain softmax
    cfg = load_config(DEFAULT, ["trainer.total_steps=3", "trainer.mini_batches_per_step=2",
                                "trainer.lr_warmup_steps=5"])
    validate(cfg)  # 5 < 6 updates
    with pytest.raises(ConfigError, match=r"trainer.lr_warmup_steps=6 .* = 6\)"):
        validate(load_config(DEFAULT, ["trainer.total_steps=3", "trainer.mini_batches_per_step=2",
                                    "trainer.lr_warmup_steps=6"]))


def test_the_policys_lr_schedule_counts_its_own_updates():
    """Critic-only steps train the critic alone: the policy's LR schedule decays over the other steps'
    updates (it stopped short of min_lr by the critic-only steps' share)."""
    cfg = load_config(DEFAULT, ["algorithm.advantage=gae", "critic.critic_only_steps=3", "trainer.total_steps=10",
                                "trainer.mini_batches_per_step=2", "trainer.epochs_per_step=2"])
    assert (cfg.trainer.total_updates, cfg.policy_updates) == (40, 28)
    assert load_config(DEFAULT, ["critic.critic_only_steps=3"]).policy_updates == 35  # grpo: no critic, no skip


def test_wandb_project_without_wandb_installed_fails_in_the_launcher(monkeypatch, capsys):
    """Before, the run failed at its first metrics line: after the engines, the trainer ranks and
    the first weight sync, with a traceback. Checked by the launcher only: the trainer ranks
    re-validate the config and never log to W&B."""
    import importlib.util

    from mlrl import launch
    from mlrl.config.validate import check_driver

    cfg = load_config(DEFAULT, ["logging.wandb_project=demo"])
    check_driver(cfg)  # installed here (the wandb extra)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="logging.wandb_project='demo': Weights & Biases is not installed here"):
        check_driver(cfg)
    validate(cfg, has_cuda=False)  # what each rank runs: no W&B needed there
    assert launch.main(["logging.wandb_project=demo"]) == 2
    assert "config error: logging.wandb_project='demo': Weights & Biases is not installed" in capsys.readouterr().err
    assert launch.main(["logging.wandb_project=demo", "--print-config"]) == 0  # a plan / print made elsewhere


def test_the_distillation_recipe_validates_and_names_its_missing_teacher():
    """launch/distill_cpu.yaml distils from `make demo`'s export: without it, one line naming the field
    and the folder; with a teacher there, the recipe is a valid on-policy distillation run."""
    recipe = ROOT / "launch" / "distill_cpu.yaml"
    cfg = load_config(recipe, ["algorithm.reference_hf_dir=/nonexistent/hf/step_000035"])
    with pytest.raises(ConfigError, match="^algorithm.reference_hf_dir: folder '/nonexistent/hf/step_000035' does not "
                                          "exist"):
        validate(cfg, has_cuda=False)
    cfg = load_config(recipe, ["algorithm.reference_hf_dir=builtin:tiny-qwen3"])
    validate(cfg, has_cuda=False)
    a = cfg.algorithm
    assert (a.advantage, a.gamma, a.kl_in_reward, a.kl_estimator, a.kl_coef) == ("reinforce_pp", 0.0, True, "k1", 1.0)


def test_a_kl_reference_needs_a_row_for_every_token_the_policy_samples(tmp_path):
    """A teacher's padded embedding may be larger than the policy's (one tokenizer, other padding:
    Qwen2.5-7B and -1.5B); smaller, a sampled token could have no row. The tokenizers themselves
    are compared by the launcher (tests/unit/test_launch_errors.py)."""
    small = _model_dir(tmp_path / "small", vocab_size=64)
    with pytest.raises(ConfigError, match=r"^algorithm.reference_hf_dir: vocab_size 64 is smaller than the policy's "
                                          r"72 \(model.hf_dir\)"):
        validate(load_config(DEFAULT, [f"algorithm.reference_hf_dir={small}"]), has_cuda=False)
    validate(load_config(DEFAULT, [f"algorithm.reference_hf_dir={_model_dir(tmp_path / 'big', vocab_size=80)}"]),
             has_cuda=False)

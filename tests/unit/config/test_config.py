"""Config loading, overrides and validation: each bad config fails with its own one-line message."""

import subprocess
import sys
from pathlib import Path

import pytest

from mlrl.config import ConfigError, dump_yaml, load_config, validate

ROOT = Path(__file__).resolve().parents[3]
DEFAULT = ROOT / "launch" / "cpu_default.yaml"


def test_defaults_and_overrides_types():
    cfg = load_config(DEFAULT, ["trainer.lr=3e-4", "parallel.tp=2", "rollout.sampling.top_p=0.9", "data.eval=null"])
    assert cfg.trainer.lr == pytest.approx(3e-4) and isinstance(cfg.trainer.lr, float)
    assert cfg.parallel.tp == 2 and cfg.rollout.sampling.top_p == 0.9 and cfg.data.eval is None
    assert "lr: 0.0003" in dump_yaml(cfg)


def test_default_recipe_validates():
    layout = validate(load_config(DEFAULT), has_cuda=False)
    assert layout.dp == 1 and layout.trainer_devices == 1


def test_dp_derived_from_world_size():
    layout = validate(load_config(DEFAULT, ["trainer.world_size=2"]), has_cuda=False)
    assert layout.dp == 2


BAD = [
    (["trainer.lrr=1"], "unknown config key 'trainer.lrr' (did you mean 'trainer.lr'?)"),
    (["trainr.lr=1"], "unknown config key 'trainr' (did you mean 'trainer'?)"),
    (["parallel.tp=two"], "parallel.tp: got 'two' (str), expected an integer"),
    (["trainer.lr=-1"], "trainer.lr: got -1.0, expected > 0"),
    (["rollout.sampling.top_p=1.5"], "rollout.sampling.top_p: got 1.5, expected in (0, 1]"),
    (["trainer.world_size=3", "parallel.tp=2"], "does not divide the trainer's 3 devices"),
    (["trainer.world_size=4", "parallel.tp=2", "parallel.dp=3"], "tp*pp*cp*dp = 2*3 = 6 does not equal the trainer's 4 devices"),
    (["trainer.world_size=3", "parallel.tp=3"], "parallel.tp=3 must divide the model's num_attention_heads=4"),
    (["trainer.world_size=4", "parallel.tp=4"], "parallel.tp=4 must divide the model's num_key_value_heads=2"),
    (["trainer.world_size=3", "parallel.pp=3"], "parallel.pp=3 must divide the model's num_hidden_layers=2"),
    (["trainer.world_size=2", "parallel.pp=2", "parallel.pp_layer_split=[1,2]"], "must be positive and sum to num_hidden_layers=2"),
    (["model.hf_dir=builtin:tiny-qwen3-moe", "trainer.world_size=3", "parallel.ep=3"], "parallel.ep=3 must divide the model's num_experts=4"),
    (["parallel.ep=2", "trainer.world_size=2"], "parallel.ep=2 but the model"),
    (["trainer.fp8_recipe=delayed"], "trainer.fp8_recipe='delayed' needs GPUs"),
    (["trainer.fp8_recipe=fp4"], "trainer.fp8_recipe: got 'fp4', expected one of"),
    (["parallel.cp=2", "trainer.world_size=2"], "parallel.cp=2: context parallel needs GPUs"),
    (["rollout.staleness=-1"], "rollout.staleness: got -1, expected >= 0"),
    (["mode=async", "rollout.staleness=1"], "needs importance-sampling correction"),
    (["model.hf_dir=/nonexistent/model"], "model.hf_dir: folder '/nonexistent/model' does not exist"),
    (["model.hf_dir=builtin:nope"], "unknown builtin model 'nope'"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel needs parallel.tp >= 2"),
    (["cluster.gpus_per_node=8"], "this machine has no CUDA device"),
    (["trainer.deterministic=maybe"], "trainer.deterministic: got 'maybe', expected true or false"),
    (["rollout.sampling.max_new_tokens=1000"], "exceeds the model's max_position_embeddings=256"),
    (["model.hf_dir=builtin:tiny-qwen3-moe", "trainer.world_size=2", "parallel.tp=2"], "needs parallel.sequence_parallel=true"),
    (["trainer.world_size=2", "parallel.pp=2", "parallel.vpp=2"], "virtual pipeline stages are GPU only"),
    (["checkpoint.async_save=true"], "checkpoint.async_save needs GPUs"),
    (["trainer.warmup_steps=5", "trainer.total_steps=5"], "trainer.warmup_steps=5 must be smaller than the optimizer updates"),
    (["trainer.warmup_steps=10", "trainer.total_steps=5", "trainer.epochs_per_step=2"], "(trainer.total_steps * mini_batches_per_step * epochs_per_step = 10)"),
    (["algorithm.advantage=gae", "critic=null"], "algorithm.advantage=gae needs a critic: add a `critic:` section"),
    (["algorithm.advantage=gae", "critic.lr=0"], "critic.lr: got 0.0, expected > 0"),
    (["algorithm.advantage=gae", "critic.warmup_steps=10", "trainer.total_steps=10"], "critic.warmup_steps=10 (critic-only RL steps) must be smaller"),
    (["algorithm.advantage=gae", "critic.value_clip=-1"], "critic.grad_clip / weight_decay / value_clip: expected >= 0"),
    (["algorithm.advantage=gae", "critic.hf_dir=builtin:smollm2-135m-instruct"], "critic.hf_dir: vocab_size 49152 differs"),
    (["trainer.prompts_per_step=6", "trainer.mini_batches_per_step=4"], "trainer.mini_batches_per_step=4 must divide the prompt groups of a step"),
    (["trainer.epochs_per_step=0"], "trainer.epochs_per_step: got 0, expected >= 1"),
    (["algorithm.rollout_is=icepop", "algorithm.icepop_low=2", "algorithm.icepop_high=0.5"], "algorithm.icepop_low / icepop_high: got [2.0, 0.5]"),
    (["algorithm.rollout_is=icepop", "algorithm.icepop_low=0"], "algorithm.icepop_low / icepop_high: got [0.0, 5.0]"),
    (["eval.samples_per_prompt=0"], "eval.samples_per_prompt: got 0, expected >= 1"),
    (["algorithm.dynamic_sampling.max_rounds=0"], "algorithm.dynamic_sampling.max_rounds: got 0, expected >= 1"),
    (["algorithm.dynamic_sampling=true"], "algorithm.dynamic_sampling: expected a mapping of fields"),
    (["algorithm.advantage=rloo", "algorithm.std_normalize=false"], "algorithm.std_normalize=false has no effect with algorithm.advantage='rloo'"),
    (["algorithm.use_rollout_logprobs=true", "algorithm.rollout_is=tis"], "algorithm.use_rollout_logprobs=true makes the behaviour logprobs"),
    (["cluster.nodes=2", "cluster.gpus_per_node=8", "cluster.join_timeout_s=0"], "cluster.join_timeout_s: got 0.0, expected > 0 (seconds)"),
    (["cluster.nodes=2"], "cluster.nodes=2 needs cluster.gpus_per_node >= 1"),
    (["cluster.nodes=2", "cluster.gpus_per_node=8", "cluster.placement=colocated", "weight_sync.transport=cuda_ipc"],
     "cluster.nodes=2 puts engines on other nodes: use weight_sync.transport=broadcast"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[b[0][0] for b in BAD])
def test_bad_config_fails_with_clear_message(overrides, message):
    with pytest.raises(ConfigError) as ei:
        validate(load_config(DEFAULT, overrides), has_cuda=False)
    assert message in str(ei.value)
    assert "\n" not in str(ei.value)


def test_missing_config_file_and_bad_override():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nope.yaml")
    with pytest.raises(ConfigError, match="must look like a.b=value"):
        load_config(DEFAULT, ["trainer.lr"])


def test_missing_model_config_json(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        validate(load_config(DEFAULT, [f"model.hf_dir={tmp_path}"]), has_cuda=False)


def test_print_config_cli():
    out = subprocess.run([sys.executable, "-m", "mlrl.launch", "--config", str(DEFAULT), "trainer.lr=0.5", "--print-config"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "lr: 0.5" in out.stdout and "hf_dir: builtin:tiny-llama" in out.stdout


def test_cli_bad_config_exit_code():
    out = subprocess.run([sys.executable, "-m", "mlrl.launch", "parallel.tp=3", "trainer.world_size=3", "--print-config"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert "config error: parallel.tp=3 must divide" in out.stderr


def test_multi_node_run_without_a_ray_cluster_fails_clearly_before_starting_anything(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "mlrl.launch", "--nodes", "2", "cluster.gpus_per_node=8",
                          f"cluster.ray_address=127.0.0.1:{port}", f"logging.run_dir={tmp_path}/run"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 4, out.stderr[-2000:]
    assert f"cluster error: cluster.ray_address='127.0.0.1:{port}': nothing accepts connections there" in out.stderr
    assert not (tmp_path / "run" / "trainer.log").exists() and not (tmp_path / "run" / "engines").exists()

"""What a reward-model run checks before any process starts: its config (ranges; RL settings it would
ignore and settings it cannot honour are rejected; a pair must fit a micro-batch), the checkpoints it
and an RL run resume (each its own kind), and that a reward model's HF export is never taken for a
policy. Also the exported config: a causal LM's config.json turned into a one-label sequence
classifier's."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.launching import launch_refused

from mlrl.ckpt_files.hf_folder import sequence_classifier_config
from mlrl.config import ConfigError, load_config, validate
from mlrl.modelzoo import resolve_model_dir

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "launch" / "rm_cpu.yaml"
TINY = ["model.hf_dir=builtin:tiny-llama", "rm.max_seq_tokens=64", "data.train=synthetic:copy_digit",
        "data.eval=synthetic:copy_digit"]


def _validated(*overrides: str, recipe: Path = RECIPE):
    cfg = load_config(recipe, list(overrides))
    validate(cfg)
    return cfg


def test_recipe_is_a_reward_model_run_on_smollm2():
    cfg = _validated()
    assert cfg.rm is not None and cfg.dpo is None and cfg.sft is None and cfg.offline == "rm"
    assert cfg.offline_section is cfg.rm and cfg.trains_on_pairs
    assert cfg.model.hf_dir == "builtin:smollm2-135m-instruct" and cfg.rm.center_rewards_coefficient == 0.0
    assert not cfg.uses_shared_prefix_packing


@pytest.mark.parametrize("override, field", [
    ("rollout.num_engines=2", "rollout.num_engines"),
    ("algorithm.kl_coef=0.1", "algorithm.kl_coef"),
    ("workflow.reward=gsm8k", "workflow.reward"),
    ("trainer.prompts_per_step=3", "trainer.prompts_per_step"),
    ("data.max_prompt_tokens=64", "data.max_prompt_tokens"),
    ("critic.lr=1e-3", "critic"),
    ("reward_model.hf_dir=builtin:tiny-llama", "reward_model"),
])
def test_rl_settings_are_rejected(override, field):
    with pytest.raises(ConfigError, match=f"^{field.replace('.', '[.]')}.*reward-model run"):
        _validated(override)


@pytest.mark.parametrize("override, message", [
    ("rm.batch_size=0", "rm.batch_size"),
    ("rm.center_rewards_coefficient=-0.1", r"rm.center_rewards_coefficient=-0.1: expected a finite number >= 0"),
    ("rm.max_seq_tokens=600", r"rm.max_seq_tokens=600: a pair .* must fit one micro-batch.*raise it to >= 1200"),
    ("dpo.beta=0.1", "dpo and rm: a run is"),
    ("model.lora.rank=4", r"model.lora: a reward-model run \(rm: section\) trains every weight"),
    ("model.init_from=/somewhere", r"model.init_from=/somewhere: a reward-model run \(rm: section\) starts from a "
                                   "Hugging Face folder"),
    ("cluster.placement=colocated", "cluster.placement=colocated: a reward-model run starts no engines"),
])
def test_rm_ranges(override, message):
    with pytest.raises(ConfigError, match=message):
        _validated(override)


def test_context_parallelism_is_refused_on_gpu():
    """A sequence's score is read at its last position, which CP would put on another rank."""
    with pytest.raises(ConfigError, match=r"parallel.cp=2: a reward-model run \(rm: section\) reads each sequence's "
                                          "last position"):
        _validated("parallel.cp=2", "cluster.gpus_per_node=2")


def test_the_sequence_limit_is_checked_against_the_model():
    with pytest.raises(ConfigError, match="rm.max_seq_tokens=512 exceeds the model's max_position_embeddings=256"):
        _validated(*TINY[:1], "rm.max_seq_tokens=512")


def test_dry_run_plans_a_scalar_head_without_engines():
    out = subprocess.run([sys.executable, "-m", "mlrl.launch", "--config", str(RECIPE), *TINY, "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "reward model (Bradley-Terry): 8 preference pairs = 16 sequences per optimizer step" in out.stdout
    assert "engines  none: a reward-model run trains on a fixed dataset" in out.stdout


@pytest.fixture(scope="module")
def classifier_folder(tmp_path_factory) -> Path:
    """The tiny Llama's folder with the config a reward model's export has."""
    src = resolve_model_dir("builtin:tiny-llama")
    out = tmp_path_factory.mktemp("rm") / "tiny-rm"
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(sequence_classifier_config(cfg)))
    return out


def test_a_reward_model_is_not_a_policy(classifier_folder):
    with pytest.raises(ConfigError, match="model.hf_dir: a LlamaForSequenceClassification .a reward model"):
        _validated(f"model.hf_dir={classifier_folder}", "rm.max_seq_tokens=64", recipe=RECIPE)
    with pytest.raises(ConfigError, match="model.hf_dir: a LlamaForSequenceClassification"):
        _validated(f"model.hf_dir={classifier_folder}", recipe=ROOT / "launch" / "cpu_default.yaml")
    from mlrl.checkpoint.init_from import check_model_init_from

    cfg = load_config(ROOT / "launch" / "cpu_default.yaml", [f"model.init_from={classifier_folder}"])
    with pytest.raises(ConfigError, match=r"model.init_from: .*tiny-rm is a LlamaForSequenceClassification"):
        check_model_init_from(cfg.model, resolve_model_dir(cfg.model.hf_dir), resume=None)


def test_classifier_config_from_a_causal_lm():
    out = sequence_classifier_config({"architectures": ["Qwen3ForCausalLM"], "eos_token_id": [7, 8],
                                      "problem_type": "regression", "hidden_size": 8})
    assert out["architectures"] == ["Qwen3ForSequenceClassification"] and out["num_labels"] == 1
    assert out["id2label"] == {"0": "LABEL_0"} and out["pad_token_id"] == 7 and "problem_type" not in out
    assert out["hidden_size"] == 8
    assert sequence_classifier_config({"architectures": ["LlamaForCausalLM"], "pad_token_id": 3,
                                       "eos_token_id": 2})["pad_token_id"] == 3
    with pytest.raises(ValueError, match="name no .*ForCausalLM"):
        sequence_classifier_config({"architectures": ["BertModel"]})


def _checkpoint(root: Path, kind: str) -> Path:
    step = root / "ckpts" / "step_000001"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"kind": kind, "step": 1, "sampler": {}}))
    (step / "COMPLETE").write_text("")
    (root / "ckpts" / "latest").write_text("step_000001")
    return root / "ckpts"


def test_a_reward_model_run_resumes_only_its_own_checkpoints(tmp_path):
    ckpts = _checkpoint(tmp_path, "dpo")
    out = launch_refused("--config", str(RECIPE), *TINY, f"checkpoint.dir={ckpts}",
                         f"logging.run_dir={tmp_path / 'run'}", "logging.progress_bar=false")
    assert out.returncode == 2, out.stderr[-2000:]
    assert ("is a DPO checkpoint; a reward-model run resumes RM checkpoints (to train a reward model on its weights: "
            "model.hf_dir=") in out.stderr


def test_an_rl_run_does_not_resume_a_reward_model_checkpoint(tmp_path):
    ckpts = _checkpoint(tmp_path, "rm")
    out = launch_refused(f"checkpoint.dir={ckpts}", f"logging.run_dir={tmp_path / 'run'}",
                         "logging.progress_bar=false")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "is a reward-model checkpoint; an RL run scores with its HF export" in out.stderr


def _convert_error(capsys, *argv: str) -> str:
    from helpers.tools import load_tool

    rc = load_tool("convert_checkpoint").main(list(argv))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0, err  # one line, before any rank starts
    return err


def test_the_converter_refuses_a_reward_model_folder_and_a_critic_checkpoint(classifier_folder, tmp_path, capsys):
    from mlrl.ckpt_files.layout import FORMAT, MEGATRON_FILES, META_FILE

    err = _convert_error(capsys, "hf-to-mcore", "--hf", str(classifier_folder), "--out", str(tmp_path / "out"))
    assert "a LlamaForSequenceClassification (a reward model); hf-to-mcore converts causal LMs" in err
    critic = tmp_path / "critic"
    critic.mkdir()
    (critic / META_FILE).write_text(json.dumps({"format": FORMAT, "role": "critic", "hf_config": {}}))
    for f in MEGATRON_FILES:
        (critic / f).write_text("{}")
    err = _convert_error(capsys, "mcore-to-hf", "--ckpt", str(critic), "--out", str(tmp_path / "out"))
    assert "a PPO critic's checkpoint (a value head on the policy's body) has no Hugging Face form" in err


def test_sequences_lose_their_pad_tail_so_transformers_scores_the_last_token(classifier_folder):
    """transformers' classifier scores the last token that is not the pad id; the trainer and vLLM
    score the last token. A string row's appended EOS is the pad id when the model pads with EOS: the
    reward-model job and the classifier judge drop such a tail, after which transformers' score IS
    the last position's (the trainer's)."""
    import torch
    import transformers

    from mlrl.jobs.rm import classifier_pad_id, strip_pad_tail
    from mlrl.reward.model import ClassifierJudge

    cfg = json.loads((classifier_folder / "config.json").read_text())
    eos = cfg["eos_token_id"]
    cfg["pad_token_id"] = eos  # the EOS-padded case (SmolLM2; the export's default without a pad token)
    folder = classifier_folder.parent / "eos-padded"
    shutil.copytree(classifier_folder, folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    assert classifier_pad_id(folder) == eos
    ids, mask = [1, 5, 7, 9, eos], [0, 0, 1, 1, 1]
    assert strip_pad_tail((ids, mask), eos) == ([1, 5, 7, 9], [0, 0, 1, 1])
    assert strip_pad_tail(([eos, eos], [0, 1]), eos) == ([eos], [0])  # never empty
    assert strip_pad_tail((ids, mask), None) == (ids, mask)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        model.score.weight.normal_()
        out = model(torch.tensor([ids[:4]]), output_hidden_states=True)
        last_position = float(model.score(out.hidden_states[-1][0, -1]))  # the trainer's read
        assert float(model(torch.tensor([ids])).logits[0, 0]) == float(out.logits[0, 0])  # the EOS is skipped
    assert abs(float(out.logits[0, 0]) - last_position) < 1e-6
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    judge = ClassifierJudge(None, tok, pad_id=eos)
    raw = ClassifierJudge(None, tok).conversation_ids("copy 3", "3")
    assert judge.conversation_ids("copy 3", "3") == strip_pad_tail((raw, [0] * len(raw)), eos)[0]


def test_a_reward_model_may_start_the_critic_but_not_be_a_teacher(classifier_folder, tmp_path):
    default = ROOT / "launch" / "cpu_default.yaml"
    cfg = _validated("algorithm.advantage=gae", f"critic.hf_dir={classifier_folder}", recipe=default)
    assert cfg.uses_critic  # its score head starts the value head (tests/integration/rm: the values are its scores)
    two = tmp_path / "two-labels"
    shutil.copytree(classifier_folder, two)
    c = json.loads((two / "config.json").read_text())
    c["id2label"], c["num_labels"] = {"0": "bad", "1": "good"}, 2
    (two / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConfigError, match="critic.hf_dir: a LlamaForSequenceClassification with 2 labels"):
        _validated("algorithm.advantage=gae", f"critic.hf_dir={two}", recipe=default)
    with pytest.raises(ConfigError, match=r"algorithm.reference_hf_dir: a LlamaForSequenceClassification .* gives no "
                                          "token log-probabilities"):
        _validated("algorithm.kl_coef=0.1", f"algorithm.reference_hf_dir={classifier_folder}", recipe=default)

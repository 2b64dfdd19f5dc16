"""What an SFT run checks before any process starts: its config (ranges; RL settings it would
ignore are rejected), the tokenizer's chat template, and the rows (no assistant turn: skipped and
named)."""

import json
import shutil
from pathlib import Path

import pytest

from mlrl.config import ConfigError, load_config, validate
from mlrl.modelzoo import resolve_model_dir

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "launch" / "sft_cpu.yaml"


def _validated(*overrides: str):
    cfg = load_config(RECIPE, list(overrides))
    validate(cfg)
    return cfg


def test_recipe_is_an_sft_run():
    cfg = _validated()
    assert cfg.sft is not None and cfg.sft.batch_size == 64 and cfg.critic is None


@pytest.mark.parametrize("override, field", [
    ("rollout.num_engines=2", "rollout.num_engines"),
    ("algorithm.kl_coef=0.1", "algorithm.kl_coef"),
    ("workflow.reward=gsm8k", "workflow.reward"),
    ("weight_sync.transport=disk", "weight_sync.transport"),
    ("trainer.prompts_per_step=4", "trainer.prompts_per_step"),
    ("data.max_prompt_tokens=64", "data.max_prompt_tokens"),
    ("critic.lr=1e-3", "critic"),
])
def test_rl_settings_are_rejected(override, field):
    with pytest.raises(ConfigError, match=f"^{field.replace('.', '[.]')}"):
        _validated(override)


@pytest.mark.parametrize("override, message", [
    ("sft.batch_size=0", "sft.batch_size"),
    ("sft.max_seq_tokens=4096", "sft.max_seq_tokens=4096 exceeds trainer.micro_batch_tokens"),
    ("sft.max_seq_tokens=512", "sft.max_seq_tokens=512 exceeds the model's max_position_embeddings=256"),
])
def test_sft_ranges(override, message):
    with pytest.raises(ConfigError, match=message):
        _validated(override, "trainer.micro_batch_tokens=2048")


def test_an_rl_recipe_is_not_an_sft_run():
    cfg = load_config(ROOT / "launch" / "cpu_default.yaml", [])
    validate(cfg)
    assert cfg.sft is None


def test_missing_chat_template_is_a_config_error(tmp_path):
    from mlrl.jobs.sft import load_sft_data

    model = tmp_path / "no_template"
    shutil.copytree(resolve_model_dir("builtin:tiny-llama"), model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((model / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(tc))
    cfg = _validated(f"model.hf_dir={model}")
    with pytest.raises(ConfigError, match="model.hf_dir: the tokenizer of .* has no chat template"):
        load_sft_data(cfg, model)


def test_rows_without_an_assistant_turn_are_skipped_and_named(tmp_path, caplog):
    from mlrl.jobs.sft import load_sft_data

    rows = [{"messages": [{"role": "user", "content": "copy 3"}, {"role": "assistant", "content": "3"}]},
            {"messages": [{"role": "user", "content": "copy 5"}]},
            {"prompt": "copy 4", "completion": "4"}]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _validated(f"data.train={data}", "data.eval=null")
    with caplog.at_level("WARNING", logger="mlrl.jobs.sft"):
        train, held_out = load_sft_data(cfg, resolve_model_dir("builtin:tiny-llama"))
    assert len(train) == 2 and held_out is None
    assert len(train.no_assistant) == 1 and "train.jsonl:2" in train.no_assistant[0]
    assert "skipped 1 row(s) without an assistant turn" in caplog.text and "train.jsonl:2" in caplog.text


def test_an_rl_run_does_not_resume_an_sft_checkpoint(tmp_path):
    from helpers.launching import launch_refused

    step = tmp_path / "ckpts" / "step_000001"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"kind": "sft", "step": 1, "sampler": {}}))
    (step / "COMPLETE").write_text("")
    (tmp_path / "ckpts" / "latest").write_text("step_000001")
    out = launch_refused(f"checkpoint.dir={tmp_path / 'ckpts'}", f"logging.run_dir={tmp_path / 'run'}",
                         "logging.progress_bar=false")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "is a supervised fine-tuning checkpoint" in out.stderr and "model.hf_dir" in out.stderr

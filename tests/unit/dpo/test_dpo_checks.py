"""What a DPO run checks before any process starts: its config (ranges; RL settings it would ignore
are rejected; a pair must fit a micro-batch), its data (a bad row is a config error naming the row),
and the checkpoint it resumes (its own kind only)."""

import json
import subprocess
from pathlib import Path

import pytest
from helpers.launching import launch_refused

from mlrl.config import ConfigError, load_config, validate

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "launch" / "dpo_cpu.yaml"
TINY = ["model.hf_dir=builtin:tiny-llama", "dpo.max_seq_tokens=64", "data.train=synthetic:copy_digit",
        "data.eval=synthetic:copy_digit"]


def _validated(*overrides: str):
    cfg = load_config(RECIPE, list(overrides))
    validate(cfg)
    return cfg


def test_recipe_is_a_dpo_run_on_smollm2():
    cfg = _validated()
    assert cfg.dpo is not None and cfg.sft is None and cfg.offline == "dpo"
    assert cfg.model.hf_dir == "builtin:smollm2-135m-instruct" and cfg.dpo.loss_type == "sigmoid"
    assert not cfg.uses_shared_prefix_packing


@pytest.mark.parametrize("override, field", [
    ("rollout.num_engines=2", "rollout.num_engines"),
    ("algorithm.kl_coef=0.1", "algorithm.kl_coef"),
    ("workflow.reward=gsm8k", "workflow.reward"),
    ("trainer.samples_per_prompt=3", "trainer.samples_per_prompt"),
    ("data.max_prompt_tokens=64", "data.max_prompt_tokens"),
    ("trainer.shared_prefix_packing=always", "trainer.shared_prefix_packing"),
    ("critic.lr=1e-3", "critic"),
])
def test_rl_settings_are_rejected(override, field):
    with pytest.raises(ConfigError, match=f"^{field.replace('.', '[.]')}.*DPO run"):
        _validated(override)


@pytest.mark.parametrize("override, message", [
    ("dpo.batch_size=0", "dpo.batch_size"),
    ("dpo.beta=0", "dpo.beta=0.0: expected > 0"),
    ("dpo.loss_type=hinge", "dpo.loss_type='hinge': expected sigmoid .DPO. or ipo"),
    ("dpo.max_seq_tokens=600", r"dpo.max_seq_tokens=600: a pair .* must fit one micro-batch.*raise it to >= 1200"),
    ("sft.batch_size=4", "sft and dpo"),
    ("cluster.placement=colocated", "cluster.placement=colocated: a DPO run starts no engines"),
])
def test_dpo_ranges(override, message):
    with pytest.raises(ConfigError, match=message):
        _validated(override)


def test_the_sequence_limit_is_checked_against_the_model():
    with pytest.raises(ConfigError, match="dpo.max_seq_tokens=512 exceeds the model's max_position_embeddings=256"):
        _validated(*TINY[:1], "dpo.max_seq_tokens=512")


def _launch(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return launch_refused("--config", str(RECIPE), *TINY, f"logging.run_dir={tmp_path / 'run'}",
                          "logging.progress_bar=false", *overrides)


def test_a_bad_row_stops_the_run_before_any_process_starts(tmp_path):
    data = tmp_path / "prefs.jsonl"
    data.write_text(json.dumps({"prompt": "copy 3", "chosen": "3", "rejected": "4"}) + "\n"
                    + json.dumps({"prompt": "copy 4", "chosen": "4"}) + "\n")
    out = _launch(tmp_path, f"data.train={data}", "data.eval=null")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "config error: data.train:" in out.stderr
    assert "prefs.jsonl:2: a preference row needs 'rejected'" in out.stderr
    assert "trainer" not in out.stderr.lower().split("config error")[0]  # no rank was started


@pytest.mark.parametrize("kind, named", [("sft", "an SFT checkpoint"), ("rl", "an RL checkpoint")])
def test_a_dpo_run_resumes_only_dpo_checkpoints(tmp_path, kind, named):
    step = tmp_path / "ckpts" / "step_000001"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"kind": kind, "step": 1, "sampler": {}}))
    (step / "COMPLETE").write_text("")
    (tmp_path / "ckpts" / "latest").write_text("step_000001")
    out = _launch(tmp_path, f"checkpoint.dir={tmp_path / 'ckpts'}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert named in out.stderr and "a DPO run resumes DPO checkpoints" in out.stderr


def test_an_rl_run_does_not_resume_a_dpo_checkpoint(tmp_path):
    step = tmp_path / "ckpts" / "step_000001"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"kind": "dpo", "step": 1, "sampler": {}}))
    (step / "COMPLETE").write_text("")
    (tmp_path / "ckpts" / "latest").write_text("step_000001")
    out = launch_refused(f"checkpoint.dir={tmp_path / 'ckpts'}", f"logging.run_dir={tmp_path / 'run'}",
                         "logging.progress_bar=false")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "is a preference optimisation (DPO) checkpoint" in out.stderr and "model.init_from" in out.stderr

"""User mistakes the RL job finds in its cheap checks (mlrl.jobs.rl._checks: tokenizer, checkpoint
to resume, data, workflow), before any trainer rank starts: each is one line naming the field, with
the launcher's exit code 2, never a traceback."""

from pathlib import Path

import pytest

from mlrl import launch
from mlrl.ckpt_files.errors import CheckpointError
from mlrl.config import ConfigError, load_config, validate
from mlrl.jobs.rl import _checks
from mlrl.modelzoo import resolve_model_dir

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "launch" / "cpu_default.yaml"


def _check(tmp_path: Path, *overrides: str):
    cfg = load_config(DEFAULT, list(overrides))
    validate(cfg, has_cuda=False)
    return _checks(cfg, resolve_model_dir(cfg.model.hf_dir), tmp_path)


@pytest.mark.parametrize("overrides,message", [
    (["workflow.name=rlvrr"], "workflow.name: unknown workflow 'rlvrr'"),
    (["workflow.reward=exact_matc"], "exact_matc"),
    (["workflow.kwargs={foo: 1}"], "unexpected keyword argument 'foo'"),
    # the longest copy_digit prompt is 7 tokens: 7 + 32 new tokens do not fit 32
    (["trainer.micro_batch_tokens=32", "rollout.sampling.max_new_tokens=32"],
     "trainer.micro_batch_tokens=32 is smaller than a full-length sample: the longest prompt of data.train (7 "
     "tokens with its chat template) + rollout.sampling.max_new_tokens (32) = 39"),
])
def test_workflow_and_budget_mistakes_are_config_errors(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as ei:
        _check(tmp_path, *overrides)
    assert message in str(ei.value) and "\n" not in str(ei.value)


def test_the_sample_fit_check_counts_prompts_as_the_workflow_renders_them(tmp_path, monkeypatch):
    """rlvr renders prompts with its own template kwargs (enable_thinking): the data filter and the
    sample-fit check measure that rendering, not the plain template's (7 tokens for copy_digit)."""
    from mlrl.workflow.builtin.rlvr import RLVRWorkflow

    plain = RLVRWorkflow.prompt_ids
    monkeypatch.setattr(RLVRWorkflow, "prompt_ids", lambda self, row: plain(self, row) + [0] * 4)
    with pytest.raises(ConfigError, match=r"the longest prompt of data.train \(11 tokens"):
        _check(tmp_path, "trainer.micro_batch_tokens=42", "rollout.sampling.max_new_tokens=32")


def test_a_budget_that_fits_the_longest_sample_passes(tmp_path):
    assert _check(tmp_path, "trainer.micro_batch_tokens=39", "rollout.sampling.max_new_tokens=32").workflow


def test_a_missing_checkpoint_to_resume_is_named_and_reported_without_a_traceback(tmp_path, monkeypatch, capsys):
    with pytest.raises(CheckpointError, match=r"checkpoint.resume: 'latest' does not exist \(expected auto, none"):
        _check(tmp_path, "checkpoint.resume=latest")

    def job(cfg, layout):
        raise CheckpointError("checkpoint.resume: 'latest' does not exist")

    monkeypatch.setattr("mlrl.jobs.job_for", lambda cfg: job)
    assert launch.main([f"logging.run_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err == "checkpoint error: checkpoint.resume: 'latest' does not exist\n"


def test_overrides_may_stand_on_both_sides_of_an_option(capsys):
    assert launch.main(["trainer.lr=1e-4", "--print-config", "trainer.seed=3"]) == 0
    out = capsys.readouterr().out
    assert "  lr: 0.0001\n" in out and "  seed: 3\n" in out


def test_prompts_left_out_by_max_prompt_tokens_are_reported(tmp_path, caplog):
    import json
    import logging

    rows = [{"messages": [{"role": "user", "content": "copy 3"}], "answer": "3"},
            {"messages": [{"role": "user", "content": " ".join(["copy"] * 40)}], "answer": "1"}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{oops\n")
    with caplog.at_level(logging.WARNING, logger="mlrl"):
        _check(tmp_path, f"data.train={data}", "data.max_prompt_tokens=24", "data.skip_malformed=true")
    text = caplog.text
    assert "data.train: left out 1 of 2 prompt(s) longer than data.max_prompt_tokens=24" in text
    assert "data.train: skipped 1 malformed row(s)" in text and "d.jsonl:3: invalid JSON" in text


def _model_copy(tmp_path: Path, *drop: str) -> Path:
    """builtin:tiny-llama copied without the files named in `drop`."""
    import shutil

    src = resolve_model_dir("builtin:tiny-llama")
    dst = tmp_path / "model"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*drop))
    return dst


def _check_folder(tmp_path: Path, model: Path):
    cfg = load_config(DEFAULT, [f"model.hf_dir={model}"])
    validate(cfg, has_cuda=False)  # config.json alone passes validation (a dry run plans from it)
    return _checks(cfg, model, tmp_path / "run")


def test_a_model_folder_without_weights_fails_before_any_rank_starts(tmp_path):
    """Before, it passed every check and failed in the trainer ranks' bridge or the engines."""
    import shutil

    model = _model_copy(tmp_path, "model.safetensors")
    with pytest.raises(ConfigError, match=r"model.hf_dir: .*/model has no weights: expected \*.safetensors "
                                          r"\(model.safetensors or shards with model.safetensors.index.json\)$"):
        _check_folder(tmp_path, model)
    (model / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"; found pytorch_model.bin, which the trainer does not read"):
        _check_folder(tmp_path, model)
    # unindexed shards are weights the bridge reads (mlrl.bridge.HFCheckpoint): accepted
    shutil.copy(resolve_model_dir("builtin:tiny-llama") / "model.safetensors",
                model / "model-00001-of-00001.safetensors")
    assert _check_folder(tmp_path, model).workflow


def test_a_model_folder_without_tokenizer_files_names_the_folder(tmp_path):
    """transformers' own error blamed a missing sentencepiece / tiktoken."""
    model = _model_copy(tmp_path, "tokenizer*", "special_tokens_map.json")
    with pytest.raises(ConfigError, match=r"^model.hf_dir: no tokenizer loads from .*/model \(expected tokenizer.json"):
        _check_folder(tmp_path, model)


def test_a_tokenizer_without_a_chat_template_is_a_config_error_in_rl_too(tmp_path):
    """SFT / DPO said so already; an RL run ended in transformers' traceback."""
    import json

    model = _model_copy(tmp_path, "chat_template.jinja")
    cfg_path = model / "tokenizer_config.json"
    tc = json.loads(cfg_path.read_text())
    tc.pop("chat_template", None)
    cfg_path.write_text(json.dumps(tc))
    with pytest.raises(ConfigError, match=r"model.hf_dir: the tokenizer of .*/model has no chat template, which "
                                          r"renders the conversations of data.train"):
        _check_folder(tmp_path, model)


def test_a_dataset_scored_by_another_reward_than_its_own_is_said(tmp_path, caplog):
    """data.train=gsm8k with the default exact_match scored 0.0 everywhere: the run learnt nothing,
    silently. A deliberate choice (math_verify on gsm8k) stays allowed, with the warning."""
    import logging

    with caplog.at_level(logging.WARNING, logger="mlrl"):
        _check(tmp_path, "data.train=synthetic:copy_digit", "workflow.reward=exact_match")
    assert "is made for" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="mlrl"):
        _check(tmp_path, "data.train=synthetic:copy_digit", "workflow.reward=gsm8k")
    assert "data.train=synthetic:copy_digit is made for the 'exact_match' reward, and workflow.reward='gsm8k' " \
           "scores it" in caplog.text


def test_a_kl_reference_must_hold_weights_and_read_the_policys_tokens(tmp_path):
    """algorithm.reference_hf_dir (a teacher): equal vocabulary sizes pass validation, but its folder
    must hold weights and its tokenizer must map every token to the policy's id."""
    from mlrl.modelzoo import SPECIALS, WORDS, build_word_tokenizer

    teacher = _model_copy(tmp_path, "model.safetensors")
    with pytest.raises(ConfigError, match=r"^algorithm.reference_hf_dir: .*/model has no weights"):
        _check(tmp_path, f"algorithm.reference_hf_dir={teacher}")
    import shutil

    shutil.copy(resolve_model_dir("builtin:tiny-llama") / "model.safetensors", teacher / "model.safetensors")
    assert _check(tmp_path, f"algorithm.reference_hf_dir={teacher}").workflow
    other = tmp_path / "other"
    shutil.copytree(teacher, other)
    swapped = SPECIALS + WORDS[1:2] + WORDS[:1] + WORDS[2:]  # two words trade ids: same size, other tokens
    build_word_tokenizer(other, swapped)
    with pytest.raises(ConfigError, match=r"^algorithm.reference_hf_dir: .*/other's tokenizer maps tokens to other ids "
                                          r"than the policy's \(model.hf_dir\), e.g. "):
        _check(tmp_path, f"algorithm.reference_hf_dir={other}")
    # a builtin of another architecture with the policy's vocabulary is a valid teacher
    assert _check(tmp_path, "algorithm.reference_hf_dir=builtin:tiny-qwen3").workflow

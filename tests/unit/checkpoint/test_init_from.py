"""`model.init_from` checked before any process starts (mlrl.ckpt_files.init_source, logged by
mlrl.checkpoint.init_from): every bad input
is a ConfigError naming the field, the path and what was expected. The fake checkpoints carry the
JSON files an mlrl checkpoint has (committed through CheckpointManager, mlrl_checkpoint.json with
the keys save_checkpoint writes); the fake HF folders a config.json and an empty safetensors file."""

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlrl.checkpoint.init_from import check_model_init_from
from mlrl.checkpoint.manager import CheckpointManager
from mlrl.ckpt_files.init_source import check_init_from
from mlrl.ckpt_files.layout import CRITIC_DIR, FORMAT, META_FILE, TRAINER_DIR
from mlrl.config import ConfigError, ModelConfig

ROOT = Path(__file__).resolve().parents[3]
HF = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 72, "head_dim": 32,
      "tie_word_embeddings": True}
LORA = {"rank": 8, "alpha": 16.0, "targets": ["q_proj", "v_proj"], "dropout": 0.0, "init": "kaiming"}


def _shards(folder: Path, *, role: str = "policy", lora: dict | None = None, hf_config: dict | None = None,
            fmt: str = FORMAT) -> Path:
    folder.mkdir(parents=True)
    for f in ("metadata.json", ".metadata", "__0_0.distcp"):
        (folder / f).write_text("{}")
    meta = {"format": fmt, "backend": "torch_dist", "role": role, "model_type": "llama",
            "hf_config": hf_config or HF, "lora": lora, "base_hf_dir": "/models/base" if lora else None,
            "layout": {"tp": 1, "pp": 1}, "contents": {"model": True, "optimizer": True},
            "optimizer": {"type": "adam", "distributed": True, "steps": 4}}
    (folder / META_FILE).write_text(json.dumps(meta))
    return folder


def _checkpoint(root: Path, step: int = 4, *, kind: str | None = "sft", critic: bool = False, **meta) -> Path:
    m = CheckpointManager(root)
    tmp = m.begin(step)
    _shards(tmp / TRAINER_DIR, **meta)
    if critic:
        _shards(tmp / CRITIC_DIR, role="critic")
    state = {"sampler": {"epoch": 0}} | ({"kind": kind} if kind else {"weight_version": step})
    return m.commit(tmp, step, state)


def _hf(folder: Path, weights: bool = True, **changes) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**HF, **changes}))
    if weights:
        (folder / "model.safetensors").write_bytes(b"")
    return folder


def _fails(spec, *, match: str):
    with pytest.raises(ConfigError, match=match) as e:
        check_init_from(str(spec), HF)
    assert str(e.value).startswith("model.init_from: ")
    return str(e.value)


# ---- accepted ------------------------------------------------------------------------------------
def test_sft_checkpoint(tmp_path):
    ckpt = _checkpoint(tmp_path / "sft" / "checkpoints")
    src = check_init_from(str(ckpt), HF)
    assert (src.kind, src.path, src.weights) == ("checkpoint", ckpt, ckpt / TRAINER_DIR)
    assert src.what == "SFT checkpoint (step 4)"


def test_rl_checkpoint_of_a_run_with_a_critic(tmp_path):
    ckpt = _checkpoint(tmp_path / "rl", 6, kind=None, critic=True)  # the policy part is taken
    assert check_init_from(str(ckpt), HF).what == "RL checkpoint (step 6)"


def test_hf_folder(tmp_path):
    folder = _hf(tmp_path / "hf" / "step_000004")
    src = check_init_from(str(folder), HF)
    assert (src.kind, src.weights) == ("hf", folder)


def test_hf_folder_without_kv_heads_means_mha(tmp_path):
    mha = {k: v for k, v in HF.items() if k != "num_key_value_heads"}
    folder = tmp_path / "mha"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(mha))
    (folder / "model.safetensors").write_bytes(b"")
    assert check_init_from(str(folder), {**mha, "num_key_value_heads": 4}).kind == "hf"


# ---- refused -------------------------------------------------------------------------------------
def test_missing_empty_and_file(tmp_path):
    msg = _fails(tmp_path / "nope", match="does not exist")
    assert str(tmp_path / "nope") in msg and "checkpoints/step_N" in msg
    _fails("", match="empty")
    (tmp_path / "model.safetensors").write_bytes(b"")
    _fails(tmp_path / "model.safetensors", match="is a file; name the folder")


def test_neither_checkpoint_nor_hf_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    msg = _fails(tmp_path, match="neither an mlrl checkpoint")
    assert str(tmp_path) in msg and "config.json + *.safetensors" in msg


@pytest.mark.parametrize("field, value", [("hidden_size", 256), ("num_hidden_layers", 4), ("vocab_size", 151936),
                                          ("num_key_value_heads", 4), ("model_type", "qwen3"),
                                          ("intermediate_size", 512), ("num_attention_heads", 8)])
def test_hf_folder_of_another_architecture(tmp_path, field, value):
    folder = _hf(tmp_path / "other", **{field: value})
    msg = _fails(folder, match="does not match model.hf_dir's architecture")
    assert f"{field}: init_from {value!r}, hf_dir {HF[field]!r}" in msg and str(folder) in msg


def test_hf_folder_without_weights(tmp_path):
    folder = _hf(tmp_path / "cfg_only", weights=False)
    _fails(folder, match="has no \\*.safetensors weights")
    (folder / "adapter").mkdir()
    (folder / "adapter" / "adapter_config.json").write_text("{}")
    _fails(folder, match="only a PEFT adapter.*export_merged=true")


def test_lora_export_without_merged_weights(tmp_path):
    adapter = tmp_path / "hf" / "step_000004" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    _fails(adapter.parent, match="holds only a PEFT \\(LoRA\\) adapter.*export_merged=true")


def test_lora_checkpoint(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpts", lora=LORA)
    msg = _fails(ckpt, match="LoRA run and holds only the adapters")
    assert "merged HF export" in msg and "/models/base" in msg and str(ckpt) in msg


def test_checkpoint_of_another_architecture(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpts", hf_config={**HF, "num_hidden_layers": 30, "hidden_size": 576})
    msg = _fails(ckpt, match="does not fit model.hf_dir's architecture")
    assert "hidden_size: init_from 576, hf_dir 128" in msg and "num_hidden_layers: init_from 30, hf_dir 2" in msg


def test_critic_checkpoint(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpts", kind=None, critic=True)
    msg = _fails(ckpt / CRITIC_DIR, match="holds a critic \\(value model\\) checkpoint")
    assert f"name the checkpoint folder {ckpt}" in msg
    bare = _shards(tmp_path / "value_model", role="critic")  # the role decides, whatever the folder's name
    _fails(bare, match="holds a critic")


def test_trainer_shards_folder_points_at_its_checkpoint(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpts")
    _fails(ckpt / TRAINER_DIR, match=f"trainer shards of a checkpoint.*model.init_from={ckpt}$")


def test_incomplete_checkpoint(tmp_path):
    m = CheckpointManager(tmp_path / "ckpts")
    tmp = m.begin(4)  # killed before the commit: no COMPLETE, no trainer_state.json
    _shards(tmp / TRAINER_DIR)
    _fails(tmp, match="incomplete .*interrupted")
    ckpt = _checkpoint(tmp_path / "other")
    (ckpt / TRAINER_DIR / ".metadata").unlink()  # Megatron's own metadata missing
    _fails(ckpt, match="incomplete \\(Megatron's .metadata is missing")


def test_checkpoint_of_another_format(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpts", fmt="mlrl-megatron-dist/0")
    _fails(ckpt, match="format 'mlrl-megatron-dist/0'")


def test_run_checkpoint_root_names_the_latest(tmp_path):
    root = tmp_path / "sft" / "checkpoints"
    _checkpoint(root, 2)
    latest = _checkpoint(root, 4)
    _fails(root, match=f"a run's checkpoint folder; name one checkpoint, e.g. model.init_from={latest}$")


# ---- the driver's entry point --------------------------------------------------------------------
def test_driver_check_logs_resume_precedence(tmp_path, caplog):
    hf_dir = _hf(tmp_path / "base")
    assert check_model_init_from(ModelConfig(), hf_dir, resume=None) is None
    ckpt = _checkpoint(tmp_path / "ckpts")
    with caplog.at_level(logging.INFO, logger="mlrl.checkpoint.init_from"):
        assert check_model_init_from(ModelConfig(init_from=str(ckpt)), hf_dir, resume=None).kind == "checkpoint"
        assert "starts from the weights of SFT checkpoint (step 4)" in caplog.text
        check_model_init_from(ModelConfig(init_from=str(ckpt)), hf_dir, resume=tmp_path / "run" / "step_000002")
        assert "ignored for the policy's weights (resuming" in caplog.text and "KL reference" in caplog.text


@pytest.mark.parametrize("recipe", ["launch/cpu_default.yaml", "launch/sft_cpu.yaml"])
def test_launch_refuses_before_any_process_starts(tmp_path, recipe):
    """mlrl.jobs.rl (RL) and mlrl.jobs.sft check model.init_from first: exit code 2, nothing started."""
    from mlrl.modelzoo import hf_config_dict

    other = _hf(tmp_path / "wide", **{**hf_config_dict("builtin:tiny-llama"), "hidden_size": 256})
    from helpers.launching import launch_refused

    out = launch_refused("--config", recipe, f"model.init_from={other}", f"logging.run_dir={tmp_path / 'run'}",
                         "logging.progress_bar=false")
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"model.init_from: {other}/config.json does not match model.hf_dir's architecture: hidden_size" in out.stderr
    assert not list((tmp_path / "run").glob("trainer*"))  # no trainer process was started


# ---- the names this package repeats from the trainer side, and the trainer's key aliasing -------
def test_lora_model_keys_point_at_the_fused_norm_names_of_a_full_checkpoint():
    """A LoRA policy on the TE spec has unfused norms; a full checkpoint names them after TE's
    fused layernorm + linear (Megatron's local spec maps to those names too)."""
    from mlrl.trainer.rank.dist_ckpt import _to_saved_keys

    saved = {"decoder.layers.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.mlp.linear_fc1.weight",
             "decoder.layers.mlp.linear_fc1.layer_norm_weight", "embedding.word_embeddings.weight"}
    names = ["decoder.layers.0.input_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
             "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.input_layernorm._extra_state",
             "decoder.final_layernorm.weight"]
    sd = {n: SimpleNamespace(key=n.replace("layers.0.", "layers.")) for n in names}  # Megatron stacks the layers
    dropped = _to_saved_keys(sd, saved)
    assert dropped == ["decoder.layers.0.input_layernorm._extra_state"]
    assert {n: t.key for n, t in sd.items()} == {
        "decoder.layers.0.input_layernorm.weight": "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.pre_mlp_layernorm.weight": "decoder.layers.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.0.mlp.linear_fc1.weight": "decoder.layers.mlp.linear_fc1.weight",
        "decoder.final_layernorm.weight": "decoder.final_layernorm.weight",  # absent, no alias: the load names it
    }


def test_a_resume_must_rebuild_the_start_the_checkpoint_was_trained_from(tmp_path):
    """What a checkpoint does not hold is rebuilt from the config on resume: a LoRA run's frozen base
    and the KL reference. A relaunch without the first run's model.init_from (or with another folder)
    trained the adapters on another model, or moved the reference, silently."""
    import json as _json
    import shutil

    from mlrl.checkpoint.init_from import check_resume_same_start
    from mlrl.ckpt_files.init_source import InitSource
    from mlrl.config import ConfigError

    base, other, sft = (tmp_path / n for n in ("base", "other", "sft_export"))
    for d in (base, other, sft):  # three different models
        d.mkdir()
        (d / "config.json").write_text(_json.dumps({"name": d.name}))

    def ckpt(name, **meta):
        path = tmp_path / name
        (path / "model_optim").mkdir(parents=True)
        (path / "model_optim" / "mlrl_checkpoint.json").write_text(_json.dumps(meta))
        return path

    lora = {"rank": 8, "alpha": 16, "targets": ["q_proj"]}
    a = ckpt("a", lora=lora, base_hf_dir=str(base), init_from=None)
    check_resume_same_start(a, base, None, reference=False)
    with pytest.raises(ConfigError, match=rf"adapters trained on the base {base}; this run's base is {other}"):
        check_resume_same_start(a, other, None, reference=False)
    b = ckpt("b", lora=lora, base_hf_dir=str(sft), init_from=str(sft))  # LoRA on an SFT export (init_from)
    hf = InitSource("hf", sft, sft, "HF folder")
    check_resume_same_start(b, base, hf, reference=False)
    with pytest.raises(ConfigError, match=rf"trained on the base {sft}; this run's base is {base}"):
        check_resume_same_start(b, base, None, reference=False)  # init_from left out on the relaunch
    c = ckpt("c", lora=None, base_hf_dir=None, init_from=str(sft))  # full weights, KL reference from init_from
    check_resume_same_start(c, base, hf, reference=True)
    check_resume_same_start(c, base, None, reference=False)  # no reference: the checkpoint holds every weight
    with pytest.raises(ConfigError, match=rf"trained with model.init_from={sft}, this run has model.init_from=None: "
                                          "its KL reference would be another model"):
        check_resume_same_start(c, base, None, reference=True)
    check_resume_same_start(ckpt("d"), other, None, reference=True)  # a checkpoint from before the records
    # a copy of the base (same config.json and weight files) is the same base; a base that is not on this
    # machine any more (moved) cannot be checked: said, not refused
    (base / "config.json").write_text('{"hidden_size": 64}')
    (base / "model.safetensors").write_bytes(b"x" * 10)
    copy = tmp_path / "copy_of_base"
    shutil.copytree(base, copy)
    check_resume_same_start(a, copy, None, reference=False)
    (copy / "model.safetensors").write_bytes(b"x" * 11)
    with pytest.raises(ConfigError, match="adapters trained on the base"):
        check_resume_same_start(a, copy, None, reference=False)
    gone = ckpt("e", lora=lora, base_hf_dir=str(tmp_path / "moved_away"), init_from=None)
    check_resume_same_start(gone, base, None, reference=False)

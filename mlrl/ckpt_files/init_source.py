"""`model.init_from`: which weights a path names, checked from its JSON files alone. The driver
runs the check before any process starts (mlrl.checkpoint.init_from.check_model_init_from), and
the trainer ranks run it again (the same verdict) to know which loader to use
(mlrl.trainer.rank.dist_ckpt.init_weights_from).

`check_init_from` reads JSON files only (the checkpoint's trainer_state.json and
mlrl_checkpoint.json, or the HF folder's config.json) and tells which of the two accepted sources
the path is: an mlrl checkpoint (`<run>/checkpoints/step_N`: Megatron shards, loaded by the trainer
ranks with mlrl.trainer.rank.dist_ckpt.load_model_weights, any saved layout) or a Hugging Face
folder (`<run>/hf/step_N`: loaded through the bridge). Everything that would make that load fail or
silently train another model is a `ConfigError` naming `model.init_from`, the path and what was
expected: a missing path, a folder that is neither, weights of another architecture than
model.hf_dir's, a LoRA checkpoint (adapters only: its base is elsewhere), a critic's checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mlrl.bridge.arch import is_sequence_classifier
from mlrl.ckpt_files.layout import (
    COMPLETE,
    CRITIC_DIR,
    FORMAT,
    MEGATRON_FILES,
    META_FILE,
    STATE_FILE,
    TRAINER_DIR,
    complete_checkpoints,
    is_complete,
    latest_checkpoint,
)
from mlrl.config import ConfigError

# config.json fields that define the weights' names and shapes: they must equal model.hf_dir's
ARCH_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size")
# compared only when both configs set them (their defaults differ between model types)
ARCH_FIELDS_IF_SET = ("head_dim", "tie_word_embeddings", "num_experts", "num_local_experts", "moe_intermediate_size")

FIELD = "model.init_from"


@dataclass(frozen=True)
class InitSource:
    """Where the initial weights come from."""

    kind: Literal["checkpoint", "hf"]
    path: Path       # what model.init_from names
    weights: Path    # what the trainer loads: the checkpoint's Megatron shards (model_optim/) or the HF folder
    what: str        # for logs, e.g. "SFT checkpoint (step 4)"


def check_init_from(spec: str, hf_config: dict[str, Any]) -> InitSource:
    """Which weights `spec` (model.init_from) names, after the checks above; `hf_config` is
    model.hf_dir's config.json (the architecture the run builds)."""
    if not str(spec).strip():
        raise ConfigError(f"{FIELD}: empty; name a checkpoint or Hugging Face folder (or null: model.hf_dir's weights)")
    path = Path(spec).expanduser().resolve()
    if not path.exists():
        raise ConfigError(f"{FIELD}: {spec!r} does not exist (expected an mlrl checkpoint folder "
                          "<run>/checkpoints/step_N or a Hugging Face folder)")
    if not path.is_dir():
        raise ConfigError(f"{FIELD}: {path} is a file; name the folder that holds it (an mlrl checkpoint "
                          "<run>/checkpoints/step_N or a Hugging Face folder)")
    if (path / TRAINER_DIR / META_FILE).is_file() or (path / TRAINER_DIR).is_dir():
        return _checkpoint(path, hf_config)
    if (path / META_FILE).is_file():  # the shards folder inside a checkpoint (model_optim/ or critic/)
        meta = read_json(path / META_FILE)
        if meta.get("role") == "critic" or path.name == CRITIC_DIR:
            raise ConfigError(f"{FIELD}: {path} holds a critic (value model) checkpoint; {FIELD} takes the policy: "
                              f"name the checkpoint folder {path.parent}")
        raise ConfigError(f"{FIELD}: {path} is the trainer shards of a checkpoint; name the checkpoint folder itself: "
                          f"{FIELD}={path.parent}")
    if (path / "config.json").is_file():
        return _hf_folder(path, hf_config)
    if (path / "adapter" / "adapter_config.json").is_file() or (path / "adapter_config.json").is_file():
        raise ConfigError(f"{FIELD}: {path} holds only a PEFT (LoRA) adapter; start from merged weights: the LoRA "
                          "run's HF export written with checkpoint.export_merged=true (config.json + *.safetensors)")
    if (path / "latest").is_file() or complete_checkpoints(path):
        latest = latest_checkpoint(path)
        hint = f", e.g. {FIELD}={latest}" if latest else " (it holds no complete one)"
        raise ConfigError(f"{FIELD}: {path} is a run's checkpoint folder; name one checkpoint{hint}")
    raise ConfigError(f"{FIELD}: {path} is neither an mlrl checkpoint (step_N/ with {TRAINER_DIR}/{META_FILE}) nor a "
                      "Hugging Face folder (config.json + *.safetensors)")


def _checkpoint(path: Path, hf_config: dict[str, Any]) -> InitSource:
    weights = path / TRAINER_DIR
    if not is_complete(path) or not (weights / META_FILE).is_file():
        raise ConfigError(f"{FIELD}: checkpoint {path} is incomplete (no {COMPLETE} marker, {STATE_FILE} or "
                          f"{TRAINER_DIR}/{META_FILE}): its save was interrupted; name an earlier checkpoint")
    meta = read_json(weights / META_FILE)
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{FIELD}: checkpoint {path} has format {meta.get('format')!r}; this mlrl reads {FORMAT!r}")
    missing = [f for f in MEGATRON_FILES if not (weights / f).is_file()]
    if missing:
        raise ConfigError(f"{FIELD}: checkpoint {path} is incomplete (Megatron's {missing[0]} is missing from "
                          f"{TRAINER_DIR}/); name an earlier checkpoint")
    if meta.get("role", "policy") != "policy":
        what = "a reward model (scalar head)" if meta["role"] == "reward_model" else f"a {meta['role']} (value model)"
        raise ConfigError(f"{FIELD}: checkpoint {path} holds {what}, not a policy")
    if meta.get("lora"):
        raise ConfigError(f"{FIELD}: checkpoint {path} was written by a LoRA run and holds only the adapters (its base "
                          f"is {meta.get('base_hf_dir') or 'not recorded'}); start from the run's merged HF export "
                          "instead (<run>/hf/step_N, written with checkpoint.export_merged=true)")
    diff = _arch_differences(meta.get("hf_config") or {}, hf_config)
    if diff:
        raise ConfigError(f"{FIELD}: the model of checkpoint {path} does not fit model.hf_dir's architecture: "
                          + "; ".join(diff))
    state = read_json(path / STATE_FILE)
    kind = {"sft": "SFT", "dpo": "DPO", "rm": "RM"}.get(str(state.get("kind")), "RL")
    return InitSource("checkpoint", path, weights, f"{kind} checkpoint (step {state.get('step', '?')})")


def _hf_folder(path: Path, hf_config: dict[str, Any]) -> InitSource:
    if not any(path.glob("*.safetensors")) and not (path / "model.safetensors.index.json").is_file():
        adapter = (path / "adapter" / "adapter_config.json").is_file()
        raise ConfigError(f"{FIELD}: Hugging Face folder {path} has no *.safetensors weights"
                          + (" (only a PEFT adapter: export the LoRA run with checkpoint.export_merged=true)"
                             if adapter else ""))
    folder_config = read_json(path / "config.json")
    if is_sequence_classifier(folder_config):
        raise ConfigError(f"{FIELD}: {path} is a {folder_config['architectures'][0]} (a reward model: a score "
                          "head, no LM head), not a policy; an RL run scores with it as reward_model: "
                          "{kind: classifier, hf_dir: <it>}")
    diff = _arch_differences(folder_config, hf_config)
    if diff:
        raise ConfigError(f"{FIELD}: {path}/config.json does not match model.hf_dir's architecture: " + "; ".join(diff))
    return InitSource("hf", path, path, "Hugging Face folder")


def _arch_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    def value(cfg: dict[str, Any], key: str) -> Any:
        if key == "num_key_value_heads":
            return cfg.get(key, cfg.get("num_attention_heads"))
        return cfg.get(key)

    keys = list(ARCH_FIELDS) + [k for k in ARCH_FIELDS_IF_SET if k in theirs and k in ours]
    return [f"{k}: init_from {value(theirs, k)!r}, hf_dir {value(ours, k)!r}"
            for k in keys if value(theirs, k) != value(ours, k)]


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file the checks read; unreadable is a ConfigError naming model.init_from."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{FIELD}: cannot read {path} ({e})") from None

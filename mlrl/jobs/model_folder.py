"""The model folder's own files, checked where a job starts (before its ranks and engines do any
work): the tokenizer loads, and the weights the bridge and vLLM read are there. Validation reads
config.json only (a dry run plans from it alone), so these checks belong to the jobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlrl.config import ConfigError


def model_tokenizer(hf_dir: Path, field: str = "model.hf_dir") -> Any:
    """The folder's tokenizer. One that does not load is a ConfigError naming `field`: transformers'
    own error blames something else for a folder without tokenizer files ("You need to have
    sentencepiece or tiktoken installed")."""
    from mlrl.workflow import load_hf_tokenizer

    try:
        return load_hf_tokenizer(str(hf_dir))
    except (OSError, ValueError, TypeError) as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"{field}: no tokenizer loads from {hf_dir} (expected tokenizer.json or the tokenizer "
                          f"files with tokenizer_config.json): {type(e).__name__}: {first}") from None


def check_model_weights(hf_dir: Path, field: str = "model.hf_dir", *, bin_ok: bool = False) -> None:
    """The folder holds weights its readers load: safetensors (model.safetensors, an index of
    shards, or unindexed *.safetensors: the trainer's bridge, mlrl.bridge.HFCheckpoint, and vLLM
    read them), or with `bin_ok` (a reward model, which only vLLM loads) PyTorch *.bin files too.
    Before, a folder without weights passed every check and failed in the trainer ranks or the
    engines, after they had started."""
    if (hf_dir / "model.safetensors.index.json").is_file() or any(hf_dir.glob("*.safetensors")):
        return
    if bin_ok and any(hf_dir.glob("*.bin")):
        return
    others = sorted(p.name for p in hf_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
    raise ConfigError(f"{field}: {hf_dir} has no weights: expected *.safetensors (model.safetensors or shards with "
                      "model.safetensors.index.json)"
                      + (f"; found {', '.join(others[:4])}, which the trainer does not read: convert them to "
                         "safetensors (transformers' save_pretrained writes them)" if others else ""))


def chat_template_error(e: ValueError, hf_dir: Path, which: str, name: Any) -> ConfigError | None:
    """A ConfigError for transformers' "no chat template" error while data.<which> is rendered (None
    for any other ValueError, which keeps its traceback)."""
    from mlrl.data.rows import DatasetError

    if not isinstance(e, DatasetError) and ("chat template" in str(e).lower() or "chat_template" in str(e)):
        return ConfigError(f"model.hf_dir: the tokenizer of {hf_dir} has no chat template, which renders the "
                           f"conversations of data.{which} ({name}); add one (chat_template in "
                           "tokenizer_config.json or chat_template.jinja)")
    return None


def check_same_tokens(policy_tokenizer: Any, hf_dir: Path, field: str) -> None:
    """A model that scores the policy's token ids (a KL reference / teacher) must read them as the
    policy's tokenizer writes them: equal vocabulary sizes (validation) are not enough. Its folder's
    tokenizer, when it has one, must map every token to the same id; without one it is trusted."""
    if not any((hf_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return
    other = model_tokenizer(hf_dir, field=field).get_vocab()
    mine = policy_tokenizer.get_vocab()
    if other != mine:
        diff = sorted((t for t in set(mine) | set(other) if mine.get(t) != other.get(t)),
                      key=lambda t: (mine.get(t, other.get(t, -1)), t))[:3]
        raise ConfigError(f"{field}: {hf_dir}'s tokenizer maps tokens to other ids than the policy's (model.hf_dir), "
                          f"e.g. {', '.join(f'{t!r}: {other.get(t)} (policy: {mine.get(t)})' for t in diff)}: the KL "
                          "would compare the probabilities of different tokens")


def check_stop_tokens(sampling: Any, tokenizer: Any) -> None:
    """rollout.sampling.stop_token_ids name tokens of the model's tokenizer (an id past it would end
    nothing, or fail every request in the engine)."""
    size = len(tokenizer)
    for i, tid in enumerate(sampling.stop_token_ids):
        if tid >= size:
            raise ConfigError(f"rollout.sampling.stop_token_ids[{i}]={tid}: the tokenizer of model.hf_dir has "
                              f"{size} tokens (ids 0-{size - 1})")

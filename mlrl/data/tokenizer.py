"""The policy's tokenizer: loading it (`load_hf_tokenizer`, cached per process) and rendering a
conversation through its chat template (`apply_chat_template`, always `list[int]` when tokenizing).

Why it lives in `mlrl.data`: datasets need the chat template (the RL prompt-length filter, SFT loss
masks) and so do workflows; `mlrl.data` is the lower layer (workflows may import it, it must not
import `mlrl.workflow`), so the shared helpers sit here. `mlrl.workflow` re-exports both under
their AReaL names (`from mlrl.workflow import apply_chat_template, load_hf_tokenizer`).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], *, tokenize: bool = True, **kwargs: Any) -> Any:
    """`tokenizer.apply_chat_template` returning `list[int]` when tokenizing (transformers >= 5
    returns a BatchEncoding by default). Same helper as `areal.utils.hf_utils.apply_chat_template`."""
    if tokenize:
        kwargs.setdefault("return_dict", False)
    out = tokenizer.apply_chat_template(messages, tokenize=tokenize, **kwargs)
    if tokenize and not isinstance(out, list):
        out = out["input_ids"]
    if tokenize and out and isinstance(out[0], list):  # batched by mistake
        raise ValueError("apply_chat_template: expected one conversation (a list of message dicts)")
    return list(out) if tokenize else out


_TOKENIZERS: dict[str, Any] = {}
# the files AutoTokenizer's choice of class reads (the rest of the folder counts by name only)
_CLASS_INPUTS = ("tokenizer_config.json", "config.json")


def load_hf_tokenizer(path_or_spec: str) -> Any:
    """The HF tokenizer of a model folder or `builtin:<name>` (cached per process; pad = eos if unset):
    what `AutoTokenizer.from_pretrained` returns, through the class it chose for this folder before
    (`_class_record`) when there is a record of it."""
    from mlrl.modelzoo import resolve_model_dir

    key = str(path_or_spec)
    if key not in _TOKENIZERS:
        folder = resolve_model_dir(key)
        try:
            record = _class_record(folder)
        except (OSError, ImportError):  # ImportError: no transformers distribution metadata to key on
            record = None
        cls = _known_class(record) if record is not None else None
        if cls is not None:
            tok = cls.from_pretrained(str(folder))
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(folder))
            if record is not None:
                _remember_class(record, type(tok))
        if tok.pad_token_id is None:
            tok.pad_token_id = tok.eos_token_id
        _TOKENIZERS[key] = tok
    return _TOKENIZERS[key]


def _class_record(folder: Path) -> Path:
    """Where the class AutoTokenizer chose for `folder` is recorded: $MLRL_CACHE/tokenizer_classes/,
    keyed by everything that choice reads: the transformers release, the folder's path (matched
    against a list of model ids), the contents of tokenizer_config.json and config.json, and the
    names of the folder's files (e.g. a Mistral `tekken.json`).

    Why not call AutoTokenizer every time: importing its module imports transformers' model
    registry (`modeling_auto` -> `generation` -> torch._dynamo), ~2.5-3 CPU s of every launch on 2
    cores, for a choice that is the same each time for the same folder. The class's own
    `from_pretrained` is what AutoTokenizer calls once it has chosen."""
    from mlrl.modelzoo import cache_dir

    h = hashlib.sha256(metadata.version("transformers").encode())
    folder = folder.resolve()
    h.update(b"\0" + str(folder).encode())
    for name in sorted(p.name for p in folder.iterdir()):
        h.update(b"\0" + name.encode())
        if name in _CLASS_INPUTS:
            h.update(hashlib.sha256((folder / name).read_bytes()).digest())
    return cache_dir() / "tokenizer_classes" / f"{h.hexdigest()}.json"


def _known_class(record: Path) -> Any:
    """The tokenizer class a record names, or None (no record, or one that no longer imports)."""
    try:
        rec = json.loads(record.read_text())
        cls = getattr(importlib.import_module(rec["module"]), rec["qualname"])
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) and hasattr(cls, "from_pretrained") else None


def _remember_class(path: Path, cls: type) -> None:
    """Record AutoTokenizer's choice (written whole: a temporary file renamed over the record, so
    concurrent launches never read half of one). A cache that cannot be written is not an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump({"module": cls.__module__, "qualname": cls.__qualname__}, f)
        os.replace(tmp, path)
    except OSError:
        pass


__all__ = ["apply_chat_template", "load_hf_tokenizer"]

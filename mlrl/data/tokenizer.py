"""The policy's tokenizer: loading it (`load_hf_tokenizer`, cached per process) and rendering a
conversation through its chat template (`apply_chat_template`, always `list[int]` when tokenizing).

Why it lives in `mlrl.data`: datasets need the chat template (the RL prompt-length filter, SFT loss
masks) and so do workflows; `mlrl.data` is the lower layer (workflows may import it, it must not
import `mlrl.workflow`), so the shared helpers sit here. `mlrl.workflow` re-exports both under
their AReaL names (`from mlrl.workflow import apply_chat_template, load_hf_tokenizer`).
"""

from __future__ import annotations

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


def load_hf_tokenizer(path_or_spec: str) -> Any:
    """The HF tokenizer of a model folder or `builtin:<name>` (cached per process; pad = eos if unset)."""
    from mlrl.modelzoo import resolve_model_dir

    key = str(path_or_spec)
    if key not in _TOKENIZERS:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(key)))
        if tok.pad_token_id is None:
            tok.pad_token_id = tok.eos_token_id
        _TOKENIZERS[key] = tok
    return _TOKENIZERS[key]


__all__ = ["apply_chat_template", "load_hf_tokenizer"]

"""Preference pairs for DPO / IPO: a row -> (chosen, rejected), each `(input_ids, loss_mask)`.

Accepted rows (the formats of TRL's preference datasets, so a TRL / HF dataset file works as is):
- **standard:** `prompt`, `chosen`, `rejected` strings. Tokenised without a chat template, like
  SFT's prompt / completion rows: the prompt's tokens, then the completion's with EOS appended.
- **conversational:** `prompt` a message list (or a string, taken as one user turn), `chosen` and
  `rejected` message lists (usually one assistant turn each). The chat template renders prompt +
  completion; the loss mask covers the completion's assistant turns, never the prompt.
- **implicit prompt:** `chosen` and `rejected` whole conversations (message lists) and no `prompt`:
  the prompt is their longest common run of leading messages.

The mask of each side is 1 exactly on its completion tokens (what DPO sums log-probabilities
over); the two sides share the prompt's tokens. A row whose sides are identical, or whose
completion is empty, is malformed (DatasetError naming the row; skipped with data.skip_malformed).

`synthetic_pairs` turns a verifiable task's rows (`messages` + `answer`) into preference rows:
the row's answer is chosen, the next different answer among the task's rows is rejected.
"""

from __future__ import annotations

from typing import Any

from mlrl.data.chat_tokens import row_tools, tokenize_messages
from mlrl.data.rows import DatasetError, _short, normalise_messages
from mlrl.data.tokenizer import apply_chat_template

Side = tuple[list[int], list[int]]  # (input_ids, loss_mask)
FORMATS = "prompt/chosen/rejected strings, prompt + chosen/rejected message lists, or chosen/rejected conversations"


def _messages(v: Any, where: str, key: str) -> list[dict[str, Any]]:
    return normalise_messages(v, f"{where}: '{key}'")


def _conversational(tokenizer: Any, prompt: list[dict[str, Any]], completion: list[dict[str, Any]],
                    where: str, key: str, tools: list[dict[str, Any]] | None = None) -> Side:
    if not any(m["role"] == "assistant" for m in completion):
        raise DatasetError(f"{where}: '{key}' has no assistant turn to prefer or reject")
    ids, mask = tokenize_messages(tokenizer, prompt + completion, f"{where}: '{key}'", tools)
    kw: dict[str, Any] = {"tools": tools} if tools else {}
    head = apply_chat_template(tokenizer, prompt, add_generation_prompt=True, **kw) if prompt else []
    if ids[:len(head)] != head:
        raise DatasetError(f"{where}: the chat template renders the prompt differently once '{key}' follows it")
    return ids, [0] * len(head) + mask[len(head):]


def _standard(tokenizer: Any, prompt: str, completion: str) -> Side:
    p = list(tokenizer(prompt)["input_ids"])
    c = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        c.append(tokenizer.eos_token_id)
    mask = [0] * len(p) + [1] * len(c)
    if mask:  # an empty prompt without BOS: the first token has no logprob (nothing predicts it)
        mask[0] = 0
    return p + c, mask


def preference_example(tokenizer: Any, row: Any, where: str) -> tuple[Side, Side]:
    """One row -> (chosen, rejected); DatasetError naming the row and what was expected otherwise."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a preference row must be a JSON object, got {_short(row)}")
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise DatasetError(f"{where}: a preference row needs {' and '.join(repr(k) for k in missing)} "
                           f"({FORMATS}); keys: {sorted(row)}")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise DatasetError(f"{where}: string 'chosen' / 'rejected' need a string 'prompt', got {_short(prompt)}")
        if not chosen.strip() or not rejected.strip():
            raise DatasetError(f"{where}: 'chosen' and 'rejected' must be non-empty")
        sides = (_standard(tokenizer, prompt, chosen), _standard(tokenizer, prompt, rejected))
    else:
        c, r = _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected")
        if prompt is None:  # implicit prompt: the shared leading messages
            n = 0
            while n < min(len(c), len(r)) - 1 and c[n] == r[n]:
                n += 1
            p, c, r = c[:n], c[n:], r[n:]
        elif isinstance(prompt, str):
            p = [{"role": "user", "content": prompt}]
        else:
            p = _messages(prompt, where, "prompt")
        tools = row_tools(row, where)
        sides = (_conversational(tokenizer, p, c, where, "chosen", tools),
                 _conversational(tokenizer, p, r, where, "rejected", tools))
    if sides[0][0] == sides[1][0]:
        raise DatasetError(f"{where}: 'chosen' and 'rejected' are the same text: the pair teaches nothing")
    return sides


def synthetic_pairs(rows: list[dict[str, Any]], task: str) -> list[dict[str, Any]]:
    """Verifiable rows (`messages`, `answer`) -> conversational preference rows: chosen = the row's
    answer, rejected = the first different answer among the following rows (cyclically)."""
    answers = [str(r["answer"]) for r in rows]
    out = []
    for i, r in enumerate(rows):
        wrong = next((answers[(i + k) % len(rows)] for k in range(1, len(rows))
                      if answers[(i + k) % len(rows)] != answers[i]), None)
        if wrong is None:
            raise DatasetError(f"synthetic:{task}: every row has the answer {answers[i]!r}; no pair to build")
        out.append({"prompt": r["messages"], "chosen": [{"role": "assistant", "content": answers[i]}],
                    "rejected": [{"role": "assistant", "content": wrong}]})
    return out

"""SFT tokenisation: a conversation (or prompt + completion) -> `input_ids` + `loss_mask`.

Invariants: the loss mask is 1 exactly on the tokens of assistant turns as the chat template renders
them — without the role header the template puts before them (computed as the difference between
the conversation rendered up to that turn with a generation prompt, and rendered including it);
every other token is 0. Rendering must be prefix-stable (each longer conversation extends the
shorter one token for token); a template that re-renders earlier turns gets a clear error rather
than a silently shifted mask. Plain `prompt` + `completion` strings are tokenised without a template,
with EOS appended to the completion (trained on). A row's `tools` reach the template with every
turn (`row_tools`); a conversation opened by the assistant trains its content, not the template's
opening (`_opening_head`).
"""

from __future__ import annotations

import json
from typing import Any

from mlrl.data.rows import DatasetError, normalise_messages
from mlrl.data.tokenizer import apply_chat_template


class NoAssistantTurn(DatasetError):
    """A conversation with nothing to train on (no assistant turn, no answer): skipped and counted."""


def row_tools(row: dict[str, Any], where: str) -> list[dict[str, Any]] | None:
    """A row's `tools` (OpenAI function schemas, as TRL's tool-calling datasets carry them; a JSON
    string of them is read too): rendered by the chat template with every turn, as the agent proxy
    renders them at rollout time. None without."""
    tools = row.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: 'tools' is a string but not JSON ({e})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DatasetError(f"{where}: 'tools' must be a list of tool schemas (objects), got {type(tools).__name__}")
    return tools or None


def _opening_head(tokenizer: Any, **kw: Any) -> list[int]:
    """What the template renders before a conversation's first turn when that turn is the
    assistant's (BOS, a default system prompt, the role header): the tokens two one-turn assistant
    conversations share. An empty conversation with a generation prompt is not it: templates add
    their default system prompt only when a first message exists."""
    a = apply_chat_template(tokenizer, [{"role": "assistant", "content": "a"}], **kw)
    b = apply_chat_template(tokenizer, [{"role": "assistant", "content": "b"}], **kw)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def tokenize_messages(tokenizer: Any, messages: list[dict[str, Any]], where: str = "",
                      tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation; the mask covers assistant turns (never the first
    token, which has no logprob). `where` names the row in errors; `tools` reach the template."""
    at = f"{where}: " if where else ""
    kw: dict[str, Any] = {"tools": tools} if tools else {}
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(messages):
        full = apply_chat_template(tokenizer, messages[: i + 1], **kw)
        if m["role"] == "assistant":
            head = apply_chat_template(tokenizer, messages[:i], add_generation_prompt=True, **kw) if i \
                else _opening_head(tokenizer, **kw)
            if full[: len(head)] != head or head[: len(ids)] != ids:
                raise DatasetError(
                    f"{at}the chat template is not prefix-stable around assistant turns (turn {i}: the tokens before "
                    "its content change once the content follows, e.g. content starting with a blank line merges "
                    "with the role header's newline); cannot build a loss mask"
                )
            mask += [0] * (len(head) - len(ids)) + [1] * (len(full) - len(head))
        else:
            if full[: len(ids)] != ids:
                raise DatasetError(
                    f"{at}the chat template re-renders earlier turns when a turn is added; cannot build a loss mask"
                )
            mask += [0] * (len(full) - len(ids))
        ids = full
    if mask:
        mask[0] = 0  # the first token is never predicted
    return ids, mask


def sft_example(tokenizer: Any, row: dict[str, Any], where: str) -> tuple[list[int], list[int]]:
    """One row -> (input_ids, loss_mask). Accepted rows: `messages` with assistant turns; `prompt` +
    `completion` (or `response`) strings; an RL row (`messages` + `answer`, the answer becomes the
    assistant turn)."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a JSON object")
    if "messages" in row:
        msgs = normalise_messages(row["messages"], where)
        if not any(m["role"] == "assistant" for m in msgs):
            if row.get("answer") is None:
                raise NoAssistantTurn(f"{where}: an SFT row needs an assistant turn (or an 'answer' to use as one)")
            msgs = msgs + [{"role": "assistant", "content": str(row["answer"])}]
        return tokenize_messages(tokenizer, msgs, where, row_tools(row, where))
    completion = row.get("completion", row.get("response"))
    if isinstance(row.get("prompt"), str) and isinstance(completion, str):
        p = list(tokenizer(row["prompt"])["input_ids"])
        c = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            c.append(tokenizer.eos_token_id)
        mask = [0] * len(p) + [1] * len(c)
        if mask:  # an empty prompt without BOS: the first token has no logprob (nothing predicts it)
            mask[0] = 0
        return p + c, mask
    raise DatasetError(
        f"{where}: an SFT row needs 'messages', or 'prompt' and 'completion' strings; keys: {sorted(row)}"
    )

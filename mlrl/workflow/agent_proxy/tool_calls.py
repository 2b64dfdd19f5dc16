"""Tool calls in a model's text, as the OpenAI API returns them (`message.tool_calls`).

Two output formats, those of the model families mlrl runs:

    hermes       Qwen2.5 / Qwen3 / Hermes: one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
                 block per call, after optional text (which becomes `content`)
    llama3_json  Llama 3.1-3.3: the whole output is `{"name": ..., "parameters": {...}}` (optionally
                 after `<|python_tag|>`; several calls separated by `;`)

`detect_format` picks the format from the tokenizer's chat template (the template that renders
`tools` into the prompt teaches the model its format). A malformed call (bad JSON, no name, an
unclosed block) is never an error for the agent: the text comes back as plain content and the
failure is recorded (`ParsedToolCalls.error`).

Written here rather than taken from vLLM's tool parsers: those live in the engine's OpenAI server
(mlrl talks to vLLM in token ids, below that layer), need vLLM's request objects, and only the
rollout package may import vLLM; these two formats are a few lines of JSON each.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, cast

ToolCallFormat = Literal["hermes", "llama3_json"]
FORMATS: tuple[str, ...] = ("auto", "hermes", "llama3_json", "none")

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ParsedToolCalls:
    content: str | None                      # the text that is not a tool call (None: nothing else)
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI `tool_calls` entries
    error: str | None = None                 # why a tool call in the text was not parsed (content = the text)


def detect_format(chat_template: Any) -> ToolCallFormat | None:
    """The tool-call format the chat template teaches, or None (it renders no tools)."""
    tpl = chat_template if isinstance(chat_template, str) else json.dumps(chat_template or "")
    if "<tool_call>" in tpl:
        return "hermes"
    if _PYTHON_TAG in tpl or "ipython" in tpl:
        return "llama3_json"
    return None


def resolve_format(name: str, chat_template: Any) -> ToolCallFormat | None:
    """`name` ("auto", a format, or "none") as the format to parse with (None: do not parse)."""
    if name not in FORMATS:
        raise ValueError(f"tool_call_format: expected one of {', '.join(FORMATS)}, got {name!r}")
    if name == "auto":
        return detect_format(chat_template)
    return None if name == "none" else cast(ToolCallFormat, name)


def parse_tool_calls(text: str, fmt: ToolCallFormat | None) -> ParsedToolCalls:
    if fmt is None:
        return ParsedToolCalls(content=text)
    if fmt == "hermes":
        return _hermes(text)
    if fmt == "llama3_json":
        return _llama3_json(text)
    raise ValueError(f"unknown tool-call format {fmt!r}")


def _call(obj: Any, args_key: str) -> dict[str, Any]:
    """One OpenAI tool call from a parsed JSON object; ValueError names what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"no function name in {json.dumps(obj)[:80]}")
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models emit the arguments already as a JSON string
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError(f"{name}: arguments must be a JSON object, got {type(args).__name__}")
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _hermes(text: str) -> ParsedToolCalls:
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedToolCalls(content=text)
    try:
        blocks = _HERMES_BLOCK.findall(text)
        if text.count("<tool_call>") != len(blocks):
            raise ValueError("a <tool_call> block is not closed")
        calls = [_call(json.loads(b), "arguments") for b in blocks]
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        return ParsedToolCalls(content=text, error=f"hermes: {e}")
    content = text[:start].strip()
    return ParsedToolCalls(content=content or None, calls=calls)


def _llama3_json(text: str) -> ParsedToolCalls:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        why = "llama3_json: <|python_tag|> without a JSON call" if tagged else None
        return ParsedToolCalls(content=text, error=why)
    try:
        calls = [_call(json.loads(part), "parameters") for part in _split_top_level(body)]
    except ValueError as e:
        return ParsedToolCalls(content=text, error=f"llama3_json: {e}")
    return ParsedToolCalls(content=None, calls=calls)


def _split_top_level(body: str) -> list[str]:
    """`{...}; {...}` -> the JSON objects (a `;` inside a string or an object is not a separator)."""
    parts, depth, in_str, esc, start = [], 0, False, False, 0
    for i, ch in enumerate(body):
        if in_str:  # the character after a backslash is escaped, whatever it is (an escaped quote included)
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p.strip() for p in parts if p.strip()]


def arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message the agent sends back, with each tool call's `arguments` (a JSON string
    in the OpenAI API) as the object chat templates expect (Qwen's and Llama's render it with
    `tojson`; a string would be rendered quoted). Arguments that are not valid JSON stay strings."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                c = {**c, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except ValueError:
                pass
        out.append(c)
    return {**message, "tool_calls": out}

"""A calculator agent written only against `openai.AsyncOpenAI`, trained by the `openai_agent` workflow.

One episode: ask the model with `tools=[multiply]`; if it answers with a well-formed call, run the
tool and send its result back as a `tool` message; the next reply is the final answer. A reply
without a call (or a malformed one, which the proxy returns as plain text) is the final answer.
The agent returns no reward: `workflow.reward` (exact_match) scores the last completion's text.

    python -m mlrl.launch --config launch/calc_agent_sft_cpu.yaml   # warm start: calls the tool in a quarter of replies
    python -m mlrl.launch --config launch/calc_agent_cpu.yaml       # RL: learns to call it (and be right) almost always
"""

from __future__ import annotations

import json
from typing import Any

import openai

MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "The product of two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]},
    },
}


def run_tool(name: str, arguments: str) -> str:
    """The tool's result as text; a bad call gives an error text (the model then answers from it)."""
    try:
        args = json.loads(arguments)
        if name != "multiply":
            return f"unknown tool {name}"
        return str(int(args["a"]) * int(args["b"]))
    except (ValueError, KeyError, TypeError) as e:
        return f"error {type(e).__name__}"


class CalculatorAgent:
    async def run(self, data: dict[str, Any], **extra: Any) -> None:
        client = openai.AsyncOpenAI(base_url=extra["base_url"], api_key=extra["api_key"],
                                    http_client=extra["http_client"])
        messages: list[dict[str, Any]] = list(data["messages"])
        reply = (await client.chat.completions.create(model="policy", messages=messages, tools=[MULTIPLY])).choices[0]
        calls = reply.message.tool_calls or []
        if not calls:
            return None  # the text is the final answer
        messages.append(reply.message.model_dump(exclude_none=True))
        for c in calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": run_tool(c.function.name,
                                                                                       c.function.arguments)})
        await client.chat.completions.create(model="policy", messages=messages, tools=[MULTIPLY])
        return None

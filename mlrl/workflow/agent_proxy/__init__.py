"""How agent code written against the OpenAI client becomes trainable trajectories:
`mlrl.workflow.agent_proxy.proxy` (`OpenAIProxy`, an OpenAI-compatible HTTP server in front of the
episode's engine, one session per episode) records every completion as an `Interaction` in the
session's `InteractionLog` (`mlrl.workflow.agent_proxy.interactions`), which assigns rewards and
exports samples.

Used by the built-in `openai_agent` workflow (`mlrl.workflow.builtin.agent`) and by the Trinity
adapter's `get_openai_client` (`mlrl.workflow.compat.trinity`); kept apart from the native workflow
API because only agent-style workflows need an HTTP server (aiohttp, httpx).
"""

"""An OpenAI-compatible HTTP proxy in front of any engine with `agenerate`, recording every
completion as token ids + logprobs + weight versions so that agent code written against the
OpenAI client produces trainable trajectories.

Endpoints (aiohttp, in the caller's event loop): `POST /v1/chat/completions` (chat template
applied here with the policy's tokenizer), `POST /v1/completions`, `GET /v1/models`, and
`POST /rl/set_reward`. Each agent episode gets its own session; the session id is part of the
base URL (`http://host:port/s/<session>/v1`), and the session's API key (the same id) works with
the plain `/v1/...` paths, so concurrent episodes never mix their records. A session is bound to
the engine of its episode; ending it returns the recorded `InteractionLog`.

Tool calls: a request's `tools` are rendered into the prompt by the chat template, and the model's
text is parsed for calls in the format that template teaches (`tool_call_format`, default "auto":
mlrl.workflow.agent_proxy.tool_calls), returned as `message.tool_calls` with finish_reason
"tool_calls". A malformed call comes back as plain content and is counted on the session
(`ProxySession.tool_call_failures`). `tool` role messages and assistant messages carrying
`tool_calls` are passed to the chat template as they come (arguments as JSON objects).

Not supported (clear 400 errors): streaming, `echo`, batched prompts.

`shared_http_client()` is the one HTTP client per process (per event loop) that agent code
receives as `extra_kwargs["http_client"]`: the OpenAI SDK's own aiohttp-backed client
(`openai.DefaultAioHttpClient`, an `httpx2.AsyncClient` whose transport is aiohttp). Not a plain
`httpx.AsyncClient`: httpcore's connection pool (httpx's transport) scans every connection of the
pool, polling each socket, whenever a request is queued or a response is closed, so an agent
workflow with hundreds of episodes in flight spent most of the launcher's CPU there (measured on
the calculator agent's RL run, 128 episodes per step: 33 of the launcher's 56 CPU seconds).
tools/bench_agent_http.py compares the two through the proxy.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from mlrl.types import GenerationHyperparameters, ModelResponse, StopReason
from mlrl.workflow.agent_proxy.interactions import Interaction, InteractionLog
from mlrl.workflow.agent_proxy.tool_calls import (
    ToolCallFormat,
    arguments_as_objects,
    parse_tool_calls,
    resolve_format,
)
from mlrl.workflow.api import ModelRequest, apply_chat_template

if TYPE_CHECKING:
    import httpx2

logger = logging.getLogger(__name__)

_CLIENTS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx2.AsyncClient]" = weakref.WeakKeyDictionary()
AGENT_HTTP_MAX_CONNECTIONS, AGENT_HTTP_MAX_KEEPALIVE = 1024, 256


def shared_http_client() -> httpx2.AsyncClient:
    """The process's shared client for the running event loop (created on first use): openai's
    aiohttp-backed client, no read timeout (a generation takes as long as it takes), 30 s to
    connect, up to `AGENT_HTTP_MAX_CONNECTIONS` connections."""
    loop = asyncio.get_running_loop()
    client = _CLIENTS.get(loop)
    if client is None or client.is_closed:
        # imported here, not at the top: ~1 s that every launch would pay (the workflow registry
        # imports this module)
        import httpx2
        import openai

        limits = httpx2.Limits(max_connections=AGENT_HTTP_MAX_CONNECTIONS,
                               max_keepalive_connections=AGENT_HTTP_MAX_KEEPALIVE)
        client = openai.DefaultAioHttpClient(timeout=httpx2.Timeout(None, connect=30.0), limits=limits,
                                             verify=shared_ssl_context())
        _CLIENTS[loop] = client
    return client


_SSL_LOCK = threading.Lock()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    import httpx2

    return httpx2.create_ssl_context()


def shared_ssl_context() -> ssl.SSLContext:
    """The process's SSL context for the OpenAI clients mlrl builds (httpx2's default one, made once:
    each new one reads the CA bundle again, ~50 ms of CPU). Thread-safe: synchronous workflows
    build their clients in worker threads at once."""
    with _SSL_LOCK:
        return _ssl_context()


async def close_shared_http_client() -> None:
    client = _CLIENTS.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()


@dataclass
class ProxySession:
    """One episode's view of the proxy."""

    id: str
    engine: Any
    gconfig: GenerationHyperparameters
    base_url: str
    sampling_overrides: bool = False  # True: requests' temperature / top_p / top_k are used (off-policy
    #                                   for the trainer, whose logprobs assume the policy's own sampling)
    log: InteractionLog = field(default_factory=InteractionLog)
    tool_call_failures: list[str] = field(default_factory=list)  # why a tool call in the output did not parse
    num_tool_calls: int = 0  # tool calls parsed and returned to the agent as `tool_calls`

    @property
    def api_key(self) -> str:
        return self.id


class ProxyRequestError(Exception):
    def __init__(self, status: int, message: str, etype: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.etype = status, message, etype


_FINISH = {StopReason.STOP: "stop", StopReason.LENGTH: "length"}


class OpenAIProxy:
    """The recording proxy. `await start()` binds a port on `host` (0 = any free port)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "mlrl-policy",
        default_gconfig: GenerationHyperparameters | None = None,
        tool_call_format: str = "auto",
    ):
        self.tokenizer = tokenizer
        # checked here, before any episode: an unknown name is a ValueError naming the choices
        template = getattr(tokenizer, "chat_template", None)
        self.tool_call_format: ToolCallFormat | None = resolve_format(tool_call_format, template)
        self.host, self.port = host, port
        self.model_name = model_name
        self.default_gconfig = default_gconfig or GenerationHyperparameters()
        self._sessions: dict[str, ProxySession] = {}
        self._runner: web.AppRunner | None = None
        self._lock = asyncio.Lock()
        self.url = ""

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> str:
        async with self._lock:
            if self._runner is not None:
                return self.url
            app = web.Application(client_max_size=64 * 1024 * 1024)
            for prefix in ("/s/{sid}", ""):
                app.router.add_post(prefix + "/v1/chat/completions", self._chat)
                app.router.add_post(prefix + "/v1/completions", self._completions)
                app.router.add_get(prefix + "/v1/models", self._models)
                app.router.add_post(prefix + "/rl/set_reward", self._set_reward)
            app.router.add_get("/health", self._health)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            self._runner = runner
            self.port = runner.addresses[0][1]
            self.url = f"http://{self.host}:{self.port}"
            return self.url

    async def aclose(self) -> None:
        async with self._lock:
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None

    @property
    def started(self) -> bool:
        return self._runner is not None

    # --- sessions --------------------------------------------------------------------------
    def start_session(
        self, engine: Any, gconfig: GenerationHyperparameters | None = None, *, sampling_overrides: bool = False
    ) -> ProxySession:
        if not self.started:
            raise RuntimeError("OpenAIProxy.start() must be awaited before sessions are opened")
        sid = uuid.uuid4().hex
        s = ProxySession(
            id=sid,
            engine=engine,
            gconfig=gconfig or self.default_gconfig,
            base_url=f"{self.url}/s/{sid}/v1",
            sampling_overrides=sampling_overrides,
        )
        self._sessions[sid] = s
        return s

    def end_session(self, sid: str) -> ProxySession:
        s = self._sessions.pop(sid, None)
        if s is None:
            raise KeyError(f"no open proxy session {sid!r}")
        return s

    def _session(self, request: web.Request) -> ProxySession:
        sid = request.match_info.get("sid")
        if sid is None:
            auth = request.headers.get("Authorization", "")
            sid = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if not sid:
            raise ProxyRequestError(
                401, "no session: use the base_url given to the episode (…/s/<session>/v1) or its api_key"
            )
        s = self._sessions.get(sid)
        if s is None:
            raise ProxyRequestError(404, f"unknown or closed session {sid!r} (the episode has ended?)")
        return s

    # --- handlers ----------------------------------------------------------------------------
    @staticmethod
    def _error(e: ProxyRequestError) -> web.Response:
        return web.json_response({"error": {"message": e.message, "type": e.etype, "code": e.status}}, status=e.status)

    async def _guarded(self, request: web.Request, fn) -> web.Response:
        try:
            session = self._session(request)
            try:
                body = await request.json()
            except Exception:
                raise ProxyRequestError(400, "request body is not valid JSON") from None
            if not isinstance(body, dict):
                raise ProxyRequestError(400, "request body must be a JSON object")
            return web.json_response(await fn(session, body))
        except ProxyRequestError as e:
            return self._error(e)
        except Exception as e:  # an engine that raised instead of returning an ERROR response
            logger.warning("proxy request failed: %s: %s", type(e).__name__, e)
            return self._error(ProxyRequestError(500, f"{type(e).__name__}: {e}", "internal_error"))

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._guarded(request, self._chat_impl)

    async def _completions(self, request: web.Request) -> web.Response:
        return await self._guarded(request, self._completions_impl)

    async def _set_reward(self, request: web.Request) -> web.Response:
        async def impl(session: ProxySession, body: dict[str, Any]) -> dict[str, Any]:
            if "reward" not in body:
                raise ProxyRequestError(400, "set_reward: body needs 'reward'")
            try:
                reward = float(body["reward"])
                cid = body.get("interaction_id") or body.get("completion_id")
                session.log.set_reward(cid, reward) if cid else session.log.set_last_reward(reward)
            except (KeyError, ValueError, TypeError) as e:
                raise ProxyRequestError(400, f"set_reward: {e}") from None
            return {"ok": True}

        return await self._guarded(request, impl)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "mlrl"}]}
        )

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "sessions": len(self._sessions)})

    # --- generation ----------------------------------------------------------------------------
    def _gconfig(self, session: ProxySession, body: dict[str, Any]) -> GenerationHyperparameters:
        if body.get("stream"):
            raise ProxyRequestError(400, "streaming is not supported by the mlrl proxy (set stream=False)")
        kw: dict[str, Any] = {"n_samples": 1}
        keys = [
            ("max_completion_tokens", "max_new_tokens", int),
            ("max_tokens", "max_new_tokens", int),
            ("min_tokens", "min_new_tokens", int),
        ]
        if session.sampling_overrides:
            keys += [("temperature", "temperature", float), ("top_p", "top_p", float), ("top_k", "top_k", int)]
        for src, dst, cast in keys:
            if body.get(src) is not None and dst not in kw:
                try:
                    kw[dst] = cast(body[src])
                except (TypeError, ValueError):
                    raise ProxyRequestError(400, f"{src} must be a number, got {body[src]!r}") from None
        if "temperature" in kw:
            kw["greedy"] = kw["temperature"] == 0.0
        stop = body.get("stop")
        if stop is not None:  # the request's stop strings, besides the run's (rollout.sampling.stop)
            kw["stop"] = session.gconfig.plus_stop(stop)
        return session.gconfig.new(**kw)

    async def _generate(
        self, session: ProxySession, input_ids: list[int], gconfig: GenerationHyperparameters, n: int
    ) -> list[ModelResponse]:
        if not isinstance(n, int) or n < 1:
            raise ProxyRequestError(400, f"n must be a positive integer, got {n!r}")
        reqs = [
            ModelRequest(input_ids=list(input_ids), gconfig=gconfig, session_id=session.id, tokenizer=self.tokenizer)
            for _ in range(n)
        ]
        resps = await asyncio.gather(*(session.engine.agenerate(r) for r in reqs))
        for r in resps:
            if r.stop_reason.unfinished:
                raise ProxyRequestError(
                    502, f"engine request failed ({r.stop_reason.value}): {r.error}", "engine_error"
                )
        return list(resps)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _record(
        self, session: ProxySession, cid: str, i: int, n: int, resp: ModelResponse, text: str, gconfig, **kw: Any
    ) -> None:
        session.log.add(
            Interaction(id=cid if n == 1 else f"{cid}:{i}", model_response=resp, text=text, gconfig=gconfig, **kw)
        )

    @staticmethod
    def _usage(input_len: int, resps: list[ModelResponse]) -> dict[str, int]:
        out = sum(r.output_len for r in resps)
        return {"prompt_tokens": input_len, "completion_tokens": out, "total_tokens": input_len + out}

    async def _chat_impl(self, session: ProxySession, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ProxyRequestError(400, "messages must be a non-empty list")
        msgs = [_normalise_message(m) for m in messages]
        tpl_kw = dict(body.get("chat_template_kwargs") or {})
        if body.get("tools"):
            tpl_kw["tools"] = body["tools"]
        try:
            input_ids = apply_chat_template(self.tokenizer, msgs, add_generation_prompt=True, **tpl_kw)
        except Exception as e:
            raise ProxyRequestError(400, f"chat template failed on these messages: {type(e).__name__}: {e}") from None
        gconfig = self._gconfig(session, body)
        n = body.get("n", 1)
        resps = await self._generate(session, input_ids, gconfig, n)
        cid, choices = f"chatcmpl-{uuid.uuid4().hex}", []
        fmt = self.tool_call_format if body.get("tools") else None
        for i, r in enumerate(resps):
            text = self._decode(r.output_tokens)
            self._record(session, cid, i, len(resps), r, text, gconfig, messages=msgs)
            parsed = parse_tool_calls(text, fmt)
            if parsed.error is not None:
                session.tool_call_failures.append(parsed.error)
                logger.info("session %s: tool call not parsed (%s); returned as text", session.id, parsed.error)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            finish = _FINISH.get(r.stop_reason, "stop")
            if parsed.calls:
                session.num_tool_calls += len(parsed.calls)
                message["tool_calls"] = parsed.calls
                finish = "tool_calls" if finish == "stop" else finish
            choice: dict[str, Any] = {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": None,
                "token_ids": list(r.output_tokens),
            }
            if body.get("logprobs"):
                choice["logprobs"] = {
                    "content": [self._token_logprob(t, lp) for t, lp in zip(r.output_tokens, r.output_logprobs)]
                }
            choices.append(choice)
        return {
            "id": cid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": choices,
            "usage": self._usage(len(input_ids), resps),
            "prompt_token_ids": list(input_ids),
        }

    def _token_logprob(self, tok: int, lp: float) -> dict[str, Any]:
        s = self.tokenizer.decode([tok])
        return {"token": s, "logprob": float(lp), "bytes": list(s.encode("utf-8")), "top_logprobs": []}

    async def _completions_impl(self, session: ProxySession, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("echo"):
            raise ProxyRequestError(400, "echo is not supported by the mlrl proxy")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            input_ids = list(self.tokenizer(prompt)["input_ids"])
            prompt_text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            input_ids, prompt_text = list(prompt), None
        else:
            raise ProxyRequestError(
                400, "prompt must be one string or one list of token ids (batched prompts are not supported)"
            )
        gconfig = self._gconfig(session, body)
        resps = await self._generate(session, input_ids, gconfig, body.get("n", 1))
        cid, choices = f"cmpl-{uuid.uuid4().hex}", []
        for i, r in enumerate(resps):
            text = self._decode(r.output_tokens)
            self._record(session, cid, i, len(resps), r, text, gconfig, prompt=prompt_text)
            lp = None
            if body.get("logprobs") is not None:
                toks = [self.tokenizer.decode([t]) for t in r.output_tokens]
                offsets, pos = [], 0
                for s in toks:
                    offsets.append(pos)
                    pos += len(s)
                lp = {
                    "tokens": toks,
                    "token_logprobs": [float(x) for x in r.output_logprobs],
                    "top_logprobs": None,
                    "text_offset": offsets,
                }
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "finish_reason": _FINISH.get(r.stop_reason, "stop"),
                    "logprobs": lp,
                    "token_ids": list(r.output_tokens),
                }
            )
        return {
            "id": cid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": choices,
            "usage": self._usage(len(input_ids), resps),
            "prompt_token_ids": list(input_ids),
        }


def _normalise_message(m: Any) -> dict[str, Any]:
    if not isinstance(m, dict) or "role" not in m:
        raise ProxyRequestError(400, f"each message must be an object with a 'role', got {m!r}")
    out = dict(m)
    content = out.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text":
                parts.append(p.get("text", ""))
            else:
                raise ProxyRequestError(400, f"only text content parts are supported, got {p!r}")
        out["content"] = "".join(parts)
    elif content is None:
        out["content"] = ""
    return arguments_as_objects(out)

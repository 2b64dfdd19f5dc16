"""`POST /mlrl/generate_batch`: many `/inference/v1/generate` requests in one HTTP round trip.

Why: an RL step sends one generate request per prompt group at the same moment (the CPU demo:
32-64 of them). A profile of the CPU demo's vLLM API server showed about a third of its CPU in
the per-request HTTP path (uvicorn, the Starlette / FastAPI middleware and routing stack, request
validation, one JSON response each), and the driver paid again for each aiohttp round trip.
`EngineClient` (client.py) sends the requests it has in hand at the same moment as one body,
`{"requests": [<GenerateRequest JSON>, ...]}`; this middleware, loaded into the server with
`--middleware` next to the token check (which runs first: server.py lists it last), turns each
into vLLM's own `GenerateRequest` and runs it through the very handler of `/inference/v1/generate`
(`app.state.serving_tokens.serve_tokens`), all of them concurrently, and answers
`{"responses": [<GenerateResponse JSON> | {"error": {...}, "status": code}, ...]}` in order. So a
batched request gets exactly the sampling, validation, request id and logprobs of a single one;
one invalid request fails alone (its own status), not the batch.

A server without the scale-out handler (or a vLLM whose module layout differs) answers 404, and
the client goes back to one request each. Runs inside the vLLM API server process (imports vLLM).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable

from mlrl.rollout import vllm_compat

PATH = "/mlrl/generate_batch"

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


async def _read_body(receive: Callable) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


async def _answer(send: Callable, status: int, payload: Any) -> None:
    body = json.dumps(payload, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _error(status: int, message: str) -> dict[str, Any]:
    return {"status": status, "error": {"message": message, "code": status}}


def _exception_answer(exc: Exception) -> dict[str, Any]:
    """What vLLM's exception handlers would answer for `exc` raised by the route (a validation
    error is a 400 naming the parameter, an engine failure a 5xx)."""
    try:
        create_error_response = vllm_compat.error_response_factory()
    except ImportError:  # another vLLM layout: keep the status the exception carries, else 500
        return _error(int(getattr(exc, "status_code", 500)), f"{type(exc).__name__}: {exc}")
    err = create_error_response(exc)
    return {"status": int(err.error.code), "error": err.model_dump()["error"]}


async def _one(handler: Any, request_cls: Any, item: Any) -> dict[str, Any]:
    from pydantic import ValidationError

    try:
        # validation may raise vLLM's own errors too (SamplingParams checks, e.g. top_p > 1)
        out = await handler.serve_tokens(request_cls.model_validate(item), None)
    except ValidationError as e:
        return _error(400, str(e))
    except Exception as e:  # answered as vLLM's exception handlers would; the others go on
        return _exception_answer(e)
    if hasattr(out, "error"):  # ErrorResponse
        code = int(getattr(out.error, "code", 400) or 400)
        return {"status": code, "error": out.model_dump()["error"]}
    if not hasattr(out, "model_dump"):  # a streaming generator: batched requests are never streamed
        return _error(400, "stream=true is not supported in a batch")
    return out.model_dump()


class BatchGenerateMiddleware:
    """ASGI middleware serving `POST /mlrl/generate_batch`; every other request passes through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") != PATH:
            await self.app(scope, receive, send)
            return
        if scope.get("method") != "POST":
            await _answer(send, 405, _error(405, f"{PATH} takes POST"))
            return
        app = scope.get("app")
        handler = getattr(getattr(app, "state", None), "serving_tokens", None)
        try:
            from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
        except ImportError:
            GenerateRequest = None
        if handler is None or GenerateRequest is None:
            await _answer(send, 404, _error(404, "this server has no /inference/v1/generate handler to batch"))
            return
        try:
            items = json.loads(await _read_body(receive))["requests"]
            if not isinstance(items, list):
                raise TypeError("'requests' must be a list")
        except (ValueError, KeyError, TypeError) as e:
            await _answer(send, 400, _error(400, f"{PATH}: expected {{\"requests\": [...]}} ({e})"))
            return
        responses = await asyncio.gather(*(_one(handler, GenerateRequest, item) for item in items))
        await _answer(send, 200, {"responses": responses})

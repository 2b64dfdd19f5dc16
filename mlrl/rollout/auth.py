"""Per-job token check for every route of an mlrl vLLM server.

Why: vLLM's own `--api-key` guards only the `/v1`, `/v2`, `/inference` and `/cohere` prefixes
(vllm/entrypoints/serve/middleware/authenticate.py). The development endpoints mlrl needs
(`/collective_rpc`, `/pause`, `/resume`, `/update_weights`, `/init_weight_transfer_engine`,
`/reset_prefix_cache`, `/sleep`, ...) are registered without any check: measured, a POST to
`/collective_rpc` without a token reaches the workers. This ASGI middleware is loaded into the
server with `--middleware mlrl.rollout.auth.TokenMiddleware` (vLLM adds it last, so it runs
first) and refuses every HTTP and websocket request whose `Authorization: Bearer <token>` does
not match the job token — health and metrics included, so nothing about the job leaks either.

The token reaches the server through the environment (`MLRL_ENGINE_TOKEN`), never argv, which
other users can read in `ps`. Comparison is constant-time on SHA-256 digests.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any, Awaitable, Callable

TOKEN_ENV = "MLRL_ENGINE_TOKEN"

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def bearer_ok(headers: list[tuple[bytes, bytes]], expected_digest: bytes) -> bool:
    """True if the raw ASGI headers carry `Authorization: Bearer <token>` with the expected token."""
    for key, value in headers:
        if key.lower() == b"authorization":
            scheme, _, param = value.decode("latin-1").partition(" ")
            if scheme.lower() != "bearer":
                return False
            return hmac.compare_digest(_digest(param.strip()), expected_digest)
    return False


class TokenMiddleware:
    """Refuse (401) any request without the job token; pass the rest through unchanged."""

    def __init__(self, app: ASGIApp, token: str | None = None) -> None:
        token = token if token is not None else os.environ.get(TOKEN_ENV, "")
        if not token:
            raise RuntimeError(
                f"mlrl.rollout.auth.TokenMiddleware: ${TOKEN_ENV} is empty; refusing to serve without a job token"
            )
        self.app = app
        self._digest = _digest(token)

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket") or bearer_ok(scope.get("headers", []), self._digest):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"error":"Unauthorized: this mlrl engine requires the per-job token"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

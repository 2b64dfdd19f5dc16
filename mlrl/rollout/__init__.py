"""vLLM engines for rollouts: server processes, their HTTP client and the routing pool.

The only package that imports vllm — and only in `worker_ext` (loaded inside vLLM's worker
processes), so importing `mlrl.rollout` itself stays light. Workflows call
`await pool.agenerate(ModelRequest) -> ModelResponse`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlrl.rollout.client import (
        EngineAuthError,
        EngineClient,
        EngineError,
        EngineRequestError,
        EngineUnavailableError,
    )
    from mlrl.rollout.pool import EngineHandle, EnginePool, EngineState, PoolClosedError
    from mlrl.rollout.server import EngineServer, EngineStartError, ServerSpec

# Loaded on first use (PEP 562), like mlrl.bridge's tensor modules: every engine runs two
# `python -m mlrl.rollout.supervisor` processes (its own and a watchdog's), which need only the
# standard library; importing this package eagerly cost each of them ~0.6 s of CPU (aiohttp,
# httpx, the config schema) while the engine next to them was starting.
_LAZY = {
    **{name: "client" for name in ("EngineAuthError", "EngineClient", "EngineError", "EngineRequestError",
                                   "EngineUnavailableError")},
    **{name: "pool" for name in ("EngineHandle", "EnginePool", "EngineState", "PoolClosedError")},
    **{name: "server" for name in ("EngineServer", "EngineStartError", "ServerSpec")},
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"mlrl.rollout.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'mlrl.rollout' has no attribute {name!r}")


__all__ = ["EngineAuthError", "EngineClient", "EngineError", "EngineHandle", "EnginePool", "EngineRequestError",
           "EngineServer", "EngineStartError", "EngineState", "EngineUnavailableError", "PoolClosedError", "ServerSpec"]

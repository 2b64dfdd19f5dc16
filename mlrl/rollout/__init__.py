"""vLLM engines for rollouts: server processes, their HTTP client and the routing pool.

The only package that imports vllm — and only in `worker_ext` (loaded inside vLLM's worker
processes), so importing `mlrl.rollout` itself stays light. Workflows call
`await pool.agenerate(ModelRequest) -> ModelResponse`.
"""

from mlrl.rollout.client import EngineAuthError, EngineClient, EngineError, EngineRequestError, EngineUnavailableError
from mlrl.rollout.pool import EngineHandle, EnginePool, EngineState, PoolClosedError
from mlrl.rollout.server import EngineServer, EngineStartError, ServerSpec

__all__ = ["EngineAuthError", "EngineClient", "EngineError", "EngineHandle", "EnginePool", "EngineRequestError",
           "EngineServer", "EngineStartError", "EngineState", "EngineUnavailableError", "PoolClosedError", "ServerSpec"]

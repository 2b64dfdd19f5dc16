"""`EnginePool`: the `engine` workflows call — `await pool.agenerate(ModelRequest) -> ModelResponse`.

It owns N vLLM servers (`EngineServer`) and routes requests to them. Invariants:
- **exactly once**: every `agenerate` call returns exactly one `ModelResponse`. A request whose
  engine dies is re-issued on another engine (from the last fully received segment: nothing
  the dead engine produced after that point ever reached the caller), so no request is lost or
  answered twice; the dead engine is restarted in the background.
- **bad requests fail alone**: a request the engine refuses (prompt longer than the context,
  invalid sampling parameters, token id out of range, n_samples != 1) returns a `ModelResponse`
  with `stop_reason=ERROR` and the engine's message in `error`; `agenerate` does not raise for
  request-level failures, and the pool keeps serving.
- **routing**: least-loaded engine under a per-engine cap (`RolloutConfig.max_concurrent_requests`);
  requests carrying a `session_id` stick to the engine that served the session before (its
  prefix cache holds the conversation) while that engine is healthy.
- **versions**: every output token carries the weight version the engine recorded for it
  (engine core spans, set at `/finish_weight_update`).
- **pause / resume around weight syncs**: `pause("wait")` lets in-flight requests finish,
  `pause("abort")` interrupts them; interrupted requests wait inside `agenerate` and continue
  after `resume()` as partial rollouts — the new call's prompt is the original prompt plus the
  tokens generated so far, so the continuation is computed by the new weights on a prefix
  recomputed by them (the prefix cache is reset by the update), and the tokens before the
  interruption keep their old version. vLLM's own `pause(mode="keep")` was not used: it would
  continue on a KV cache computed by the old weights, which matches neither weight version.
- an engine restarted while the pool's version is newer than the model folder's holds stale
  weights: it is not routed to until the weight sync (the `refresher` hook, which mlrl/jobs/rl.py
  sets to `WeightSync.refresh`) brings it to the current version. If that refresh fails, the
  engine is stopped and stays out; the other engines go on. Once no engine is left (restarts
  spent), requests fail at once rather than wait for their timeout.

Construction: `EnginePool(cfg.rollout, model_dir, dtype=cfg.model.dtype, token=job_token,
run_dir=run_dir)`; `command=[...]` replaces the vLLM command line (tests use a fake engine);
`server_factory(i, spec)` builds engine i's server elsewhere (`mlrl.cluster`: on its Ray node).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Literal, Sequence

from mlrl.config.schema import RolloutConfig
from mlrl.rollout import vllm_compat
from mlrl.rollout.client import (
    EngineAuthError,
    EngineClient,
    EngineError,
    EngineRequestError,
    EngineUnavailableError,
    Segment,
)
from mlrl.rollout.server import EngineServer, EngineStartError, ServerSpec
from mlrl.types import GenerationHyperparameters, ModelRequest, ModelResponse, StopReason

if TYPE_CHECKING:  # (mlrl.interfaces imports torch: importing mlrl.rollout stays light)
    from mlrl.interfaces import EngineHandle as EngineView

log = logging.getLogger(__name__)

PauseMode = Literal["wait", "abort"]
_FINISH = {"stop": StopReason.STOP, "length": StopReason.LENGTH, "abort": StopReason.ABORT, "error": StopReason.ERROR}
_MAX_FAILOVERS = 8          # re-issues of one request after engine failures before giving up
_STICKY_SESSIONS = 100_000  # remembered session -> engine assignments (LRU)


class PoolClosedError(RuntimeError):
    """The pool was used before `start()` or after `shutdown()`."""


class EngineState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"            # routable
    STALE = "stale"            # alive, but holds an older weight version than the pool
    DEAD = "dead"              # failed; a restart is scheduled, or none will be (restarts >= the pool's max_restarts)
    RESTARTING = "restarting"
    STOPPED = "stopped"


@dataclass
class EngineHandle:
    """One engine as the pool and the weight sync see it."""

    index: int
    server: EngineServer
    client: EngineClient | None = None
    state: EngineState = EngineState.STARTING
    in_flight: int = 0
    incarnation: int = 0     # +1 per (re)start: a weight-sync group must be rebuilt when it changes
    restarts: int = 0
    running: dict[str, str] = field(default_factory=dict)  # attempt id -> request id

    @property
    def name(self) -> str:
        return self.server.spec.name

    @property
    def api(self) -> EngineClient:
        """The client of a started engine (routing and control only ever reach started ones)."""
        if self.client is None:
            raise EngineError(f"{self.name}: not started (no client)")
        return self.client

    @property
    def routable(self) -> bool:
        return self.state == EngineState.READY

    @property
    def live(self) -> bool:
        """Serving HTTP (ready or stale): what a weight sync must reach."""
        return self.state in (EngineState.READY, EngineState.STALE)


def engine_omp_threads(cfg: RolloutConfig) -> int:
    """OpenMP threads of each CPU engine: the cores but one (the driver's and the API servers'),
    shared by the engines' ranks."""
    return max(1, ((os.cpu_count() or 2) - 1) // (cfg.num_engines * cfg.engine_tp))


class EnginePool:
    """N vLLM engines behind one `agenerate`. Use as `async with EnginePool(...) as pool:`."""

    def __init__(self, cfg: RolloutConfig, model_dir: str | Path, *, dtype: str = "float32", token: str | None = None,
                 run_dir: str | Path | None = None, initial_version: int = 0,
                 cuda_devices: Sequence[Sequence[int]] | None = None, max_restarts: int = 3,
                 command: list[str] | None = None, lora_rank: int | None = None, sleep_mode: bool = False,
                 capture_routing: bool = False, runner: str | None = None,
                 server_factory: Callable[[int, ServerSpec], EngineServer] | None = None) -> None:
        if cfg.num_engines < 1:
            raise ValueError(f"rollout.num_engines must be >= 1, got {cfg.num_engines}")
        if cfg.max_concurrent_requests < 1:
            raise ValueError(f"rollout.max_concurrent_requests must be >= 1, got {cfg.max_concurrent_requests}")
        if not (Path(model_dir) / "config.json").is_file():
            raise ValueError(f"EnginePool model_dir: {model_dir} is not a Hugging Face model folder (no config.json)")
        if cuda_devices is not None and len(cuda_devices) != cfg.num_engines:
            raise ValueError(
                f"cuda_devices lists {len(cuda_devices)} engines, rollout.num_engines is {cfg.num_engines}"
            )
        if capture_routing and command is None and not _gpu_engines():
            # CPU engines capture in the worker extension (GPU: vLLM's own capture, any release)
            vllm_compat.release().require(vllm_compat.Feature.CPU_ROUTING_CAPTURE)
        self.cfg = cfg
        self.model_dir = str(model_dir)
        self.dtype = dtype
        self.token = token or secrets.token_urlsafe(32)
        self.run_dir = Path(run_dir) if run_dir else Path(f"/tmp/mlrl-engines-{os.getpid()}")
        self.initial_version = initial_version
        self.max_restarts = max_restarts
        self.capture_routing = capture_routing  # MoE router replay: engines record routed experts
        # GPU: rows that came back with the answers (vLLM's own capture), by computed token sequence
        # GPU router replay: token sequence -> the rows of each request that produced it, in arrival order
        # (two samples of a group with the same answer each get one; the newest is taken first)
        self._routing_rows: collections.OrderedDict[tuple[int, ...], list[Any]] = collections.OrderedDict()
        omp = engine_omp_threads(cfg)
        self.engines: list[EngineHandle] = []
        for i in range(cfg.num_engines):
            spec = ServerSpec.from_config(cfg, f"engine-{i}", self.model_dir, dtype, self.token, omp_threads=omp,
                                          routed_experts=capture_routing,
                                          log_path=str(self.run_dir / "engines" / f"engine-{i}.log"),
                                          cuda_devices=None if cuda_devices is None else list(cuda_devices[i]),
                                          command=command, lora_rank=lora_rank, sleep_mode=sleep_mode,
                                          runner=runner)
            self.engines.append(EngineHandle(i, server_factory(i, spec) if server_factory else EngineServer(spec)))
        self._version = initial_version
        self._pushed = False  # weights were pushed to the engines (commit_version): a restart is then stale
        self._cond = asyncio.Condition()
        self._paused = False
        self._pauses = 0  # `pause` calls so far (a failed refresh resumes only the pause it made)
        self._engines_paused: set[tuple[int, int]] = set()  # (index, incarnation) paused at the engine by `pause`
        self._started = False
        self._prestarted = False
        self._closed = False
        self._sticky: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._active: dict[str, tuple[EngineHandle, str]] = {}   # rid -> (engine, attempt id) of the running call
        self._user_aborted: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self.refresher: Callable[[], Awaitable[Any]] | None = None  # jobs/rl.py: weight_sync.refresh
        self.stats = collections.Counter()

    # ------------------------------------------------------------------ lifecycle

    def prestart(self) -> None:
        """Start the engines' server processes gated (EngineServer.start(gated=True)): they import
        vLLM while the caller checks its inputs, and build nothing until `start`. `shutdown` stops
        them if the caller gives up. Local servers only (a remote server factory starts in `start`)."""
        if self._started or self._prestarted:
            raise RuntimeError("EnginePool.prestart: the pool was already (pre)started")
        for e in self.engines:
            e.server.start(gated=True)
        self._prestarted = True

    async def start(self) -> "EnginePool":
        if self._started:
            return self
        self._started = True
        for e in self.engines:
            if self._prestarted:
                e.server.open_gate()
            else:
                e.server.start()
        results = await asyncio.gather(
            *(asyncio.to_thread(e.server.wait_ready, self.cfg.startup_timeout_s) for e in self.engines),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(asyncio.to_thread(e.server.stop) for e in self.engines))
            self._closed = True
            if all(isinstance(r, EngineStartError) for r in errors):
                raise EngineStartError("\n\n".join(str(r) for r in errors))
            raise errors[0]
        for e in self.engines:
            await self._connect(e)
        return self

    async def _connect(self, e: EngineHandle) -> None:
        if e.client is not None:
            await e.client.aclose()
        e.client = EngineClient(e.server.url, self.token, timeout_s=self.cfg.request_timeout_s,
                                max_connections=self.cfg.max_concurrent_requests + 16, name=e.name)
        await e.client.set_weight_version(self.initial_version)  # the model folder's weights
        if self.capture_routing and not _gpu_engines():
            await e.client.routing_enable()  # CPU: the worker extension captures (GPU: vLLM itself)
        e.incarnation += 1
        # a (re)started engine holds the model folder's weights: current only while no weights were ever
        # pushed (with model.init_from or a resume the first push is labelled initial_version too)
        fresh = self._version == self.initial_version and not self._pushed
        e.state = EngineState.READY if fresh else EngineState.STALE

    async def shutdown(self) -> None:
        if self._closed and not self._started:
            return
        self._closed = True
        async with self._cond:
            self._cond.notify_all()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(asyncio.to_thread(e.server.stop) for e in self.engines), return_exceptions=True)
        for e in self.engines:
            e.state = EngineState.STOPPED
            if e.client is not None:
                await e.client.aclose()

    async def __aenter__(self) -> "EnginePool":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    @property
    def version(self) -> int:
        """Weight version the routable engines hold."""
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    def live_engines(self) -> list[EngineHandle]:
        return [e for e in self.engines if e.live]

    # ------------------------------------------------------------------ generation

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for one request; returns exactly once (see the module docstring for the error contract)."""
        t0 = time.monotonic()
        resp = ModelResponse(input_tokens=list(req.input_ids), rid=req.rid)
        if not self._started or self._closed:
            raise PoolClosedError("EnginePool.agenerate called on a pool that is not started (or already shut down)")
        bad = _validate(req)
        if bad:
            return _failed(resp, bad, t0)
        self.stats["requests"] += 1
        try:
            return await asyncio.wait_for(self._run(req, resp, t0), timeout=self.cfg.request_timeout_s)
        except asyncio.TimeoutError:
            self.stats["timeouts"] += 1
            return _failed(
                resp,
                f"request {req.rid} timed out after {self.cfg.request_timeout_s:.0f} s (rollout.request_timeout_s)",
                t0,
            )
        finally:
            self._user_aborted.discard(req.rid)

    async def _run(self, req: ModelRequest, resp: ModelResponse, t0: float) -> ModelResponse:
        g = req.gconfig
        failovers = 0
        attempt = 0
        while True:
            if req.rid in self._user_aborted:
                return _finish(resp, StopReason.ABORT, t0)
            remaining = g.max_new_tokens - resp.output_len
            if remaining <= 0:
                return _finish(resp, StopReason.LENGTH, t0)
            try:
                e = await self._acquire(req)
            except PoolClosedError as err:
                return (
                    _finish(resp, StopReason.INTERRUPT, t0, error=str(err))
                    if resp.output_len
                    else _failed(resp, str(err), t0)
                )
            if e is None:  # aborted while waiting
                return _finish(resp, StopReason.ABORT, t0)
            attempt_id = f"{req.rid}-{attempt}"
            attempt += 1
            self._active[req.rid] = (e, attempt_id)
            e.running[attempt_id] = req.rid
            try:
                seg = await e.api.generate(req.input_ids + resp.output_tokens, g, request_id=attempt_id,
                                              default_version=self._version, max_tokens=remaining,
                                              min_tokens=max(0, g.min_new_tokens - resp.output_len))
            except EngineRequestError as err:
                if resp.output_len:  # a continuation no longer fits the context: the rollout is complete
                    return _finish(resp, StopReason.LENGTH, t0)
                self.stats["bad_requests"] += 1
                return _failed(resp, str(err), t0)
            except EngineAuthError as err:
                return _failed(resp, str(err), t0)
            except EngineUnavailableError as err:
                failovers += 1
                gave_up = await self._failover(req, e, err, failovers)
                if gave_up:
                    return _failed(resp, gave_up, t0)
                continue
            finally:
                e.running.pop(attempt_id, None)
                self._active.pop(req.rid, None)
                await self._release(e)
            _append(resp, seg, e.name)
            self._keep_routing(resp, seg)
            if seg.finish == "abort":
                if req.rid in self._user_aborted:
                    return _finish(resp, StopReason.ABORT, t0)
                self.stats["interrupted"] += 1
                continue  # interrupted by a weight sync: resumes after `resume()` (acquire waits)
            return _finish(resp, _FINISH.get(seg.finish, StopReason.STOP), t0)

    async def agenerate_group(self, req: ModelRequest) -> list[ModelResponse]:
        """`req.gconfig.n_samples` samples of one prompt (a GRPO group) in ONE engine request:
        the prompt is prefilled once and the HTTP, routing and engine overhead is paid once, not n
        times. Returns n responses (rids `<rid>:<i>`), each with the same contract as `agenerate`'s.
        A sample interrupted by a weight sync continues alone (an `agenerate` continuation);
        the group counts as one request under rollout.max_concurrent_requests."""
        t0 = time.monotonic()
        n = req.gconfig.n_samples
        resps = [ModelResponse(input_tokens=list(req.input_ids), rid=f"{req.rid}:{i}") for i in range(max(n, 1))]
        if not self._started or self._closed:
            raise PoolClosedError("EnginePool.agenerate_group called on a pool that is not started "
                                  "(or already shut down)")
        one = dataclasses.replace(req, gconfig=req.gconfig.new(n_samples=1))
        bad = _validate(one) or (f"GenerationHyperparameters.n_samples={n}: expected >= 1" if n < 1 else None)
        if bad:
            return [_failed(r, bad, t0) for r in resps]
        self.stats["requests"] += n
        settled: set[int] = set()  # samples that finished before a timeout (a response is STOP until set)
        try:
            return await asyncio.wait_for(self._run_group(one, resps, t0, settled),
                                          timeout=self.cfg.request_timeout_s)
        except asyncio.TimeoutError:
            self.stats["timeouts"] += 1
            msg = f"request {req.rid} timed out after {self.cfg.request_timeout_s:.0f} s (rollout.request_timeout_s)"
            return [r if i in settled else _failed(r, msg, t0) for i, r in enumerate(resps)]
        finally:
            self._user_aborted.discard(req.rid)

    async def _run_group(self, req: ModelRequest, resps: list[ModelResponse], t0: float,
                         settled: set[int]) -> list[ModelResponse]:
        g, n = req.gconfig, len(resps)
        failovers = attempt = 0
        while True:
            try:
                e = await self._acquire(req)
            except PoolClosedError as err:
                return [_failed(r, str(err), t0) for r in resps]
            if e is None:  # aborted while waiting
                return [_finish(r, StopReason.ABORT, t0) for r in resps]
            attempt_id = f"{req.rid}-{attempt}"
            attempt += 1
            self._active[req.rid] = (e, attempt_id)
            e.running[attempt_id] = req.rid
            try:
                segs = await e.api.generate_n(req.input_ids, g, n, request_id=attempt_id,
                                                 default_version=self._version, max_tokens=g.max_new_tokens,
                                                 min_tokens=g.min_new_tokens)
            except EngineRequestError as err:
                self.stats["bad_requests"] += 1
                return [_failed(r, str(err), t0) for r in resps]
            except EngineAuthError as err:
                return [_failed(r, str(err), t0) for r in resps]
            except EngineUnavailableError as err:
                failovers += 1
                gave_up = await self._failover(req, e, err, failovers)
                if gave_up:
                    return [_failed(r, gave_up, t0) for r in resps]
                continue
            finally:
                e.running.pop(attempt_id, None)
                self._active.pop(req.rid, None)
                await self._release(e)
            break

        async def settle(i: int, resp: ModelResponse, seg: Segment) -> ModelResponse:
            _append(resp, seg, e.name)
            self._keep_routing(resp, seg)
            if seg.finish != "abort":
                return _finish(resp, _FINISH.get(seg.finish, StopReason.STOP), t0)
            if req.rid in self._user_aborted:
                return _finish(resp, StopReason.ABORT, t0)
            self.stats["interrupted"] += 1  # interrupted by a weight sync: this sample continues alone
            # with its own seed, as vLLM seeds sample i of a seeded n-request (seed + i): on the group's
            # seed, samples cut at the same prefix (e.g. still queued) would continue identically
            alone = req if g.seed is None else dataclasses.replace(req, gconfig=g.new(seed=g.seed + i))
            return await self._run(dataclasses.replace(alone, rid=resp.rid), resp, t0)

        async def settle_one(i: int, resp: ModelResponse, seg: Segment) -> ModelResponse:
            out = await settle(i, resp, seg)
            settled.add(i)
            return out

        return list(await asyncio.gather(*(settle_one(i, r, s) for i, (r, s) in enumerate(zip(resps, segs)))))

    async def achat(self, messages: list[dict[str, Any]], gconfig: GenerationHyperparameters | None = None, *,
                    session_id: str | None = None, rid: str | None = None, **template_kwargs: Any) -> ModelResponse:
        """Chat variant: the engine's chat template (POST /tokenize) turns `messages` into prompt ids,
        then `agenerate`. Template errors come back as an ERROR response like any bad request."""
        req = ModelRequest(input_ids=[], gconfig=gconfig or GenerationHyperparameters(), session_id=session_id)
        if rid is not None:
            req.rid = rid
        engine = next((e for e in self.engines if e.routable), None) or next((e for e in self.engines if e.live), None)
        if engine is None:
            return _failed(
                ModelResponse(input_tokens=[], rid=req.rid),
                "no live engine to apply the chat template",
                time.monotonic(),
            )
        try:
            req.input_ids = await engine.api.tokenize_chat(messages, **template_kwargs)
        except (EngineRequestError, EngineUnavailableError) as err:
            return _failed(ModelResponse(input_tokens=[], rid=req.rid), str(err), time.monotonic())
        return await self.agenerate(req)

    async def aclassify(self, token_ids: list[int]) -> list[float]:
        """Class probabilities of one sequence from a pooling engine (`runner="pooling"`: a served
        sequence-classification reward model), on the least busy engine; EngineError when it fails."""
        req = ModelRequest(list(token_ids))
        e = await self._acquire(req)
        if e is None or e.client is None:
            raise EngineUnavailableError("no engine to classify on")
        try:
            self.stats["requests"] += 1
            return await asyncio.wait_for(e.client.classify(req.input_ids), timeout=self.cfg.request_timeout_s)
        except asyncio.TimeoutError:
            raise EngineUnavailableError(f"{e.name}: /classify timed out after {self.cfg.request_timeout_s:.0f} s "
                                         "(rollout.request_timeout_s)") from None
        finally:
            await self._release(e)

    async def abort(self, rid: str) -> bool:
        """Abort one request: its `agenerate` returns ABORT with the tokens produced so far. False if unknown."""
        self._user_aborted.add(rid)
        async with self._cond:
            self._cond.notify_all()
        active = self._active.get(rid)
        if active is None:
            return False
        e, attempt_id = active
        try:
            await e.api.abort([attempt_id])
        except (EngineUnavailableError, EngineRequestError):
            pass
        return True

    # ------------------------------------------------------------------ routing

    def _choose(self, req: ModelRequest) -> EngineHandle | None:
        cap = self.cfg.max_concurrent_requests
        if req.session_id is not None and req.session_id in self._sticky:
            e = self.engines[self._sticky[req.session_id]]
            if e.routable:
                self._sticky.move_to_end(req.session_id)
                return e if e.in_flight < cap else None  # wait for it: the conversation's KV lives there
        cands = [e for e in self.engines if e.routable and e.in_flight < cap]
        if not cands:
            return None
        e = min(cands, key=lambda x: (x.in_flight, x.index))
        if req.session_id is not None:
            self._sticky[req.session_id] = e.index
            if len(self._sticky) > _STICKY_SESSIONS:
                self._sticky.popitem(last=False)
        return e

    async def _acquire(self, req: ModelRequest) -> EngineHandle | None:
        async with self._cond:
            while True:
                if self._closed:
                    raise PoolClosedError("the engine pool was shut down")
                if self._no_engine_left():
                    raise PoolClosedError(
                        f"no engine left: every engine died and its {self.max_restarts} restarts are spent, or its "
                        f"weight refresh failed (the engine logs: {self.run_dir / 'engines'})")
                if req.rid in self._user_aborted:
                    return None
                if not self._paused:
                    e = self._choose(req)
                    if e is not None:
                        e.in_flight += 1
                        return e
                await self._cond.wait()

    async def _release(self, e: EngineHandle) -> None:
        async with self._cond:
            e.in_flight -= 1
            self._cond.notify_all()

    # ------------------------------------------------------------------ failures

    async def _failover(self, req: ModelRequest, e: EngineHandle, err: EngineUnavailableError,
                        failovers: int) -> str | None:
        """After `e` failed `req` (its `failovers`-th failure): check the engine (restart it if it is
        gone); the error that ends the request when it has failed on too many engines, else None
        (re-issue it elsewhere)."""
        self.stats["failovers"] += 1
        log.warning("request %s: %s; re-issuing elsewhere (%d)", req.rid, err, failovers)
        await self._check_engine(e)
        if failovers > _MAX_FAILOVERS:
            return f"request {req.rid} failed on {failovers} engines, last error: {err}"
        return None

    async def _check_engine(self, e: EngineHandle) -> None:
        """After a transport error: if the engine is really gone, take it out and restart it in the background."""
        if not e.live:
            return
        if e.server.alive() and await e.api.health():
            return  # transient (e.g. one request's 5xx): keep the engine
        async with self._cond:
            if not e.live:
                return
            e.state = EngineState.DEAD
            self._cond.notify_all()
        self.stats["engine_deaths"] += 1
        log.error(
            "%s died; in-flight requests are re-issued on the other engines. Log tail:\n%s",
            e.name,
            e.server.log_tail(15),
        )
        if e.restarts < self.max_restarts and not self._closed:
            t = asyncio.create_task(self._restart(e))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _restart(self, e: EngineHandle) -> None:
        e.restarts += 1
        e.state = EngineState.RESTARTING
        try:
            await asyncio.to_thread(e.server.stop)
            e.server.start()
            await asyncio.to_thread(e.server.wait_ready, self.cfg.startup_timeout_s)
            await self._connect(e)
        except Exception as err:  # the engine stays out of rotation (nothing retries a failed restart)
            e.state = EngineState.DEAD
            e.restarts = max(e.restarts, self.max_restarts)
            log.error("restart of %s failed: %s; it stays out of rotation", e.name, err)
            async with self._cond:
                self._cond.notify_all()  # waiting requests fail at once if no engine is left
            return
        self.stats["restarts"] += 1
        async with self._cond:
            self._cond.notify_all()
        if e.state == EngineState.STALE and self.refresher is not None:
            pauses = self._pauses
            try:
                await self.refresher()
            except Exception as err:  # a background task: logged, the engine taken out
                await self._refresh_failed(e, err, pauses)
            async with self._cond:
                self._cond.notify_all()

    async def _refresh_failed(self, e: EngineHandle, err: Exception, pauses: int) -> None:
        """The weight refresh of restarted `e` failed (a background task: nobody awaits it). The
        engine holds the folder's weights, not the pool's version: it is stopped and stays out. The
        refresh's sync left every engine paused; the others hold the pool's version (the refresh
        pushes the weights they already have, guarded_refresh), so they resume, unless someone
        paused the pool after the refresh's own pause (`pauses`: the count before the refresh; the
        loop's next train phase and weight sync, which resume it themselves). A fault in the
        trainer itself fails the next step's weight sync, which ends the run."""
        log.error("%s restarted, but its weight refresh failed (%s: %s): it is stopped and stays out of "
                  "rotation; the other engines go on", e.name, type(err).__name__, err)
        e.state = EngineState.DEAD
        e.restarts = max(e.restarts, self.max_restarts)  # no further restart of an engine that cannot be refreshed
        await asyncio.to_thread(e.server.stop)
        if not self._closed and self._paused and self._pauses <= pauses + 1:
            await self.resume()
        self.stats["refresh_failures"] += 1

    def _no_engine_left(self) -> bool:
        """Every engine is dead with its restart budget spent (or stopped), none restarting."""
        return all(e.state in (EngineState.DEAD, EngineState.STOPPED) and e.restarts >= self.max_restarts
                   for e in self.engines)

    def _keep_routing(self, resp: ModelResponse, seg: Segment) -> None:
        """GPU: the rows vLLM returned with a finished segment, kept (bounded) until fetch_routing."""
        if seg.routed_experts is None:
            return
        key = tuple(resp.input_tokens + resp.output_tokens)[:-1]
        self._routing_rows.setdefault(key, []).append(seg.routed_experts)
        self._routing_rows.move_to_end(key)
        while len(self._routing_rows) > _MAX_KEPT_ROUTING:
            self._routing_rows.popitem(last=False)

    def _take_routing(self, key: tuple[int, ...]) -> Any:
        rows = self._routing_rows.get(key)
        if not rows:
            return None
        row = rows.pop()  # the newest: rows of an older request never fetched (a failed or stale-dropped sample)
        #                   are from older weights
        if not rows:
            del self._routing_rows[key]
        return row

    async def fetch_routing(self, sequences: Sequence[Sequence[int]]) -> list[Any]:
        """Routed-expert rows ([m, layers, top_k], m = computed positions, normally len - 1) of
        each token sequence from whichever live engine generated it; None where no engine has it
        (an engine that died since, or rows evicted). Needs `capture_routing`."""
        if not self.capture_routing:
            raise RuntimeError("EnginePool.fetch_routing: the pool was started without capture_routing")
        out: list[Any] = [self._take_routing(tuple(q[:-1])) for q in sequences]
        for e in ([] if _gpu_engines() else self.live_engines()):
            todo = [i for i, r in enumerate(out) if r is None]
            if not todo:
                break
            try:
                rows = await e.api.routing_take([sequences[i] for i in todo])
            except EngineError as err:
                log.warning("%s: routed experts unavailable: %s", e.name, err)
                continue
            for i, r in zip(todo, rows):
                if r is not None:
                    out[i] = r
        return out

    # ------------------------------------------------------------------ weight syncs

    async def pause(self, mode: PauseMode | None = None) -> None:
        """Stop dispatching; "wait": let in-flight requests finish, "abort": interrupt them (they resume
        after `resume()`). Returns when no request is running on any engine; engines are paused too."""
        mode = mode or ("abort" if self.cfg.interrupt_on_sync else "wait")
        if mode not in ("wait", "abort"):
            raise ValueError(f"pause mode must be 'wait' or 'abort', got {mode!r}")
        self._pauses += 1
        async with self._cond:
            # already paused (e.g. by the sync loop while the trainer trained) with nothing in flight
            # and the same live engines: nothing to do (each vLLM /pause sleeps 20 ms)
            done = (self._paused and all(e.in_flight == 0 for e in self.engines)
                    and self._engines_paused == {(e.index, e.incarnation) for e in self.live_engines()})
            self._paused = True
        if done:
            return
        if mode == "abort":
            await asyncio.gather(*(e.api.pause("abort") for e in self.live_engines()), return_exceptions=True)
        while not await self._drained(timeout_s=1.0):
            if mode == "abort":  # a request that reached its engine after the engine-level abort waits there: abort it
                await asyncio.gather(*(e.api.abort(list(e.running)) for e in self.live_engines() if e.running),
                                     return_exceptions=True)
        live = self.live_engines()
        results = await asyncio.gather(*(e.api.pause("wait") for e in live), return_exceptions=True)
        self._engines_paused = {(e.index, e.incarnation) for e, r in zip(live, results)
                                if not isinstance(r, BaseException)}

    async def _drained(self, timeout_s: float) -> bool:
        async with self._cond:
            try:
                await asyncio.wait_for(
                    self._cond.wait_for(lambda: all(e.in_flight == 0 for e in self.engines) or self._closed), timeout_s
                )
                return True
            except asyncio.TimeoutError:
                return False

    def commit_version(self, version: int, engines: Sequence[EngineView], *, pushed: bool = True,
                       incarnations: dict[int, int] | None = None) -> None:
        """Record that `engines` now hold `version` (called by the weight sync before `resume`);
        `pushed=False`: the weights they loaded from the model folder themselves, checked.
        `incarnations` (index -> incarnation when the sync chose them): an engine restarted since
        holds the model folder's weights, not `version`, and stays STALE."""
        self._version = version
        self._pushed = self._pushed or pushed
        synced = {e.index: (incarnations or {}).get(e.index, e.incarnation) for e in engines}
        for e in self.engines:
            if e.live:
                e.state = EngineState.READY if synced.get(e.index) == e.incarnation else EngineState.STALE

    async def resume(self) -> None:
        """Resume the engines and dispatching; interrupted requests continue."""
        self._engines_paused = set()
        await asyncio.gather(*(e.api.resume() for e in self.live_engines()), return_exceptions=True)
        async with self._cond:
            self._paused = False
            self._cond.notify_all()


# ---------------------------------------------------------------------- response assembly


def _validate(req: ModelRequest) -> str | None:
    g = req.gconfig
    if not req.input_ids:
        return "ModelRequest.input_ids is empty (expected the prompt token ids)"
    if g.n_samples != 1:
        return (f"GenerationHyperparameters.n_samples={g.n_samples}: the pool returns one response per call; "
                "call agenerate once per sample")
    if g.max_new_tokens < 1:
        return f"GenerationHyperparameters.max_new_tokens={g.max_new_tokens}: expected >= 1"
    return None


_MAX_KEPT_ROUTING = 65536  # GPU router replay: answers' rows kept until the loop fetches them


def _gpu_engines() -> bool:
    from mlrl.rollout.server import _on_gpu

    return _on_gpu()


def _append(resp: ModelResponse, seg: Segment, engine: str) -> None:
    resp.output_tokens += seg.tokens
    resp.output_logprobs += seg.logprobs
    resp.output_versions += seg.versions
    resp.text += seg.text
    resp.engine = engine


def _finish(resp: ModelResponse, reason: StopReason, t0: float, error: str | None = None) -> ModelResponse:
    resp.stop_reason = reason
    resp.error = error
    resp.latency = time.monotonic() - t0
    return resp


def _failed(resp: ModelResponse, error: str, t0: float) -> ModelResponse:
    return _finish(resp, StopReason.ERROR, t0, error=error)

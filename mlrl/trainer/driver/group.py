"""Driver side of the trainer: starts the Megatron ranks and calls methods on all of them.

The RL loop lives in one driver process (asyncio, engines, workflows); the Megatron ranks are
separate processes started by torchrun (one machine) or by Ray (--nodes N) that run
`mlrl.trainer.rank.service` and connect back to the driver. Every call is sent to every rank (SPMD:
Megatron's collectives need all of them), optionally with per-rank arguments (each DP rank gets
its own micro-batches), and the driver waits for every reply: a failure on any rank raises
`TrainerError` naming the rank with its traceback, so the loop never continues half-done.

Channel: `multiprocessing.connection` over TCP with an HMAC authkey (the per-job token, passed
through the environment, never argv). Payloads are pickled: both ends are this job's own
processes, authenticated by the key; nothing here is exposed to untrusted clients.

This module imports no megatron: the driver stays light.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import secrets
import signal
import subprocess
import threading
import time
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Concatenate, ParamSpec, Protocol, Sequence, TypeVar

from mlrl.procs import kill_tree, torchrun_command
from mlrl.trainer.rpc import TOKEN_ENV, no_delay, recv, send

if TYPE_CHECKING:  # the rank-side class, for the types of `call` only (it is never built here)
    from mlrl.experience.batch import MicroBatch
    from mlrl.trainer.rank.service import TrainerService

P = ParamSpec("P")
R = TypeVar("R")

class TrainerError(RuntimeError):
    """A trainer rank failed; the message carries its rank and traceback."""


class RankProcesses(Protocol):
    """The processes running the ranks, however they were started (local torchrun, Ray actors)."""

    def wait(self, timeout_s: float) -> bool: ...        # True when every rank process has exited
    def kill(self) -> None: ...
    def log_tail(self, lines: int) -> str: ...


def rank_env(cfg: Any, base: dict[str, str]) -> dict[str, str]:
    """`base` (the placement's env) plus the numerics variables GPU ranks need before CUDA
    libraries start (mlrl.trainer.rank.numerics: determinism, fp32 without TF32)."""
    from mlrl.trainer.numerics_env import rank_env as numerics_env

    return {**base, **numerics_env(cfg.model, cfg.trainer, gpu=cfg.cluster.gpus_per_node > 0)}


# (service args after `python`, env for every rank) -> the started rank processes
SpawnRanks = Callable[[list[str], dict[str, str]], RankProcesses]


class LocalTorchrun:
    """All ranks on this machine under torchrun (cluster.nodes=1)."""

    def __init__(self, world_size: int, service_args: list[str], env: dict[str, str], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self._proc = subprocess.Popen(torchrun_command(world_size, *service_args), stdout=self._log,
                                      stderr=subprocess.STDOUT, env=dict(os.environ, **env),
                                      start_new_session=True, preexec_fn=die_with_parent)

    def wait(self, timeout_s: float) -> bool:
        try:
            self._proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        kill_tree(self._proc.pid)  # torchrun's workers run in sessions of their own
        self._proc.wait()
        self._log.close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            self._log.flush()
            text = self.log_path.read_text(errors="replace")
        except (OSError, ValueError):
            return ""
        return "\n".join(text.splitlines()[-lines:])


class TrainerGroup:
    """N Megatron ranks driven from this process.

    `spawn=None` starts them here under torchrun; `mlrl.cluster` passes a spawner that starts
    one process per rank on its Ray node (with torchrun's environment) and `host` = this
    machine's routable address, which the ranks connect back to. The resolved config travels
    over the authenticated connection (no shared filesystem needed for it).
    """

    def __init__(self, config_yaml: str, world_size: int, *, run_dir: str | Path, host: str = "127.0.0.1",
                 start_timeout_s: float = 300.0, env: dict[str, str] | None = None, spawn: SpawnRanks | None = None,
                 cancel: threading.Event | None = None, gate: threading.Event | None = None):
        """Starts the ranks and waits until every one said hello. `cancel` (set from another thread:
        `start_group`, on SIGTERM) stops the wait, kills the ranks and raises TrainerError; so does
        anything raised while waiting (an SFT run's SIGTERM handler): the ranks are not left behind.
        `gate` (set from another thread): the ranks start, connect and import megatron, but get the
        config, and so build their models on the devices, only once it is set (a colocated run's
        engines first take and then release the devices); the wait for it is not counted in
        `start_timeout_s`."""
        self.world_size = world_size
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._config_yaml = config_yaml
        self._token = secrets.token_bytes(32)
        self._listener = Listener((host, 0), authkey=self._token)
        self._conns: list[Connection] = []
        # one call at a time on the ranks' connections: the loop's train phase and a restarted engine's
        # weight refresh (mlrl.rollout.pool, a background task) call from different threads, and two
        # calls interleaved on one connection would mix their replies (or their collectives)
        self._call_lock = threading.RLock()
        self._procs: RankProcesses | None = None
        self.rank_info: list[dict[str, Any]] = []
        (self.run_dir / "trainer_config.yaml").write_text(config_yaml)  # for the record
        host_, port = self._listener.address
        service_args = ["-m", "mlrl.trainer.rank.service", "--connect", f"{host_}:{port}"]
        full_env = dict(env or {})
        full_env[TOKEN_ENV] = self._token.hex()
        try:
            if spawn is None:
                self._procs = LocalTorchrun(world_size, service_args, full_env, self.run_dir / "trainer.log")
            else:
                self._procs = spawn(service_args, full_env)
            self._accept_all(start_timeout_s, cancel or threading.Event(), gate)
        except BaseException:
            self.close(timeout_s=0)  # ranks still starting have nothing to finish: killed at once
            raise

    def _accept_all(self, timeout_s: float, cancel: threading.Event, gate: threading.Event | None) -> None:
        conns: dict[int, Connection] = {}
        accepted: list[Any] = []  # Connection (PipeConnection on Windows, to the type checker)
        err: list[BaseException] = []

        def accept() -> None:
            try:
                # every rank connects (authkey handshake inside accept) and gets the config before
                # any hello is awaited: a rank says hello only after the collective start-up,
                # which needs all ranks past their handshake
                while len(accepted) < self.world_size:
                    accepted.append(no_delay(self._listener.accept()))
                while gate is not None and not gate.wait(0.2):
                    if cancel.is_set():
                        return
                for c in accepted:
                    send(c, self._config_yaml)
                for c in accepted:
                    hello = recv(c)
                    if "error" in hello:
                        raise TrainerError(f"rank {hello['rank']} failed to start:\n{hello['error']}")
                    conns[hello["rank"]] = c
                    self.rank_info.append(hello)
            except BaseException as e:  # reported below
                err.append(e)

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        # the start's clock runs from when the gate is open (its wait is the engines' start, not the ranks')
        deadline = None if gate is not None else time.monotonic() + timeout_s
        exited, polls = False, 0
        while t.is_alive() and not cancel.is_set():
            if deadline is None and gate is not None and gate.is_set():
                deadline = time.monotonic() + timeout_s
            if deadline is not None and time.monotonic() >= deadline:
                break
            polls += 1  # every 2 s (with Ray, a question to each node's agent): every rank process gone?
            if polls % 10 == 0 and self._procs is not None and self._procs.wait(0):
                exited = True  # no hello can come: said now, not after the timeout
                break
            t.join(0.2)
        if cancel.is_set() and (t.is_alive() or len(conns) < self.world_size):
            raise TrainerError(f"trainer start cancelled with {len(conns)}/{self.world_size} ranks up")
        if len(conns) < self.world_size or err:
            tail = self.log_tail()
            if err:
                why = f"{type(err[0]).__name__}: {err[0]}"
            elif exited:
                why = f"the rank processes exited with {len(accepted)}/{self.world_size} ranks connected"
            elif len(accepted) < self.world_size:
                why = (f"only {len(accepted)}/{self.world_size} ranks connected within {timeout_s:g} s "
                       "(trainer.startup_timeout_s)")
            else:
                why = (f"{len(conns)}/{self.world_size} ranks built their models (said hello) within "
                       f"{timeout_s:g} s of getting the config (trainer.startup_timeout_s)")
            raise TrainerError(f"trainer ranks failed to start ({why}); log tail:\n{tail}")
        self._conns = [conns[r] for r in range(self.world_size)]
        self.rank_info.sort(key=lambda h: h["rank"])

    def call(self, method: Callable[Concatenate[TrainerService, P], R], /,
             *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Call the rank-side method `method` (a `TrainerService` method, passed as the function
        itself, never as a string) with the same arguments on every rank; the per-rank results,
        in rank order. The arguments are checked against `method`'s signature twice: by the type
        checker (`make lint`: `P` is the method's own parameters) and here, before anything is
        sent (`inspect.Signature.bind`: a wrong name or count raises TypeError on the driver)."""
        kw = _bind(method, *args, **kwargs)
        return self._call_each(method, [kw] * len(self._conns))

    def call_sharded(self, method: Callable[Concatenate[TrainerService, list[MicroBatch], P], R],
                     per_rank: Sequence[list[MicroBatch]], /, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """`call` for a method whose first argument is the rank's own micro-batches:
        `per_rank[r]` goes to rank r, the other arguments to every rank."""
        if len(per_rank) != len(self._conns):
            raise ValueError(f"got micro-batches for {len(per_rank)} ranks, the trainer has {len(self._conns)}")
        return self._call_each(method, [_bind(method, mbs, *args, **kwargs) for mbs in per_rank])

    def in_call(self) -> bool:
        """A trainer call is running on another thread (e.g. the train phase a SIGTERM cancelled
        the waiting for: its thread goes on until the ranks answer)."""
        if self._call_lock.acquire(blocking=False):
            self._call_lock.release()
            return False
        return True

    _out_of_step = False  # a call was interrupted between its requests and its replies

    def _call_each(self, method: Callable[..., R], kwargs_per_rank: Sequence[dict[str, Any]]) -> list[R]:
        with self._call_lock:
            if self._out_of_step:  # the next reply read would be the interrupted call's
                raise TrainerError(f"{_service_method_name(method)}: an earlier trainer call was interrupted "
                                   "(SIGTERM, Ctrl-C) before its replies arrived; the ranks are out of step")
            try:
                return self._call_each_locked(method, kwargs_per_rank)
            except BaseException as e:
                if not isinstance(e, Exception):  # KeyboardInterrupt, a SIGTERM raised here: replies left unread
                    self._out_of_step = True
                raise

    def _call_each_locked(self, method: Callable[..., R], kwargs_per_rank: Sequence[dict[str, Any]]) -> list[R]:
        name = _service_method_name(method)
        for c, kwargs in zip(self._conns, kwargs_per_rank):
            send(c, (name, kwargs))
        results, failures = [], []
        for r, c in enumerate(self._conns):
            try:
                status, value = recv(c)
            except (EOFError, ConnectionError, OSError) as e:
                failures.append(f"rank {r}: connection lost ({e!r}); log tail:\n{self.log_tail()}")
                results.append(None)
                continue
            if status == "ok":
                results.append(value)
            else:
                failures.append(f"rank {r}: {value}")
                results.append(None)
        if failures:
            raise TrainerError(f"trainer call {name!r} failed on {len(failures)} rank(s):\n" + "\n".join(failures))
        return results

    def log_tail(self, lines: int = 40) -> str:
        return self._procs.log_tail(lines) if self._procs is not None else ""

    def close(self, timeout_s: float = 30.0) -> None:
        for c in self._conns:
            try:
                send(c, ("shutdown", {}))
            except OSError:
                pass
        if self._procs is not None:
            self._procs.wait(timeout_s)
            self._procs.kill()  # whatever did not exit after `shutdown` (and any orphan of the group)
            self._procs = None
        for c in self._conns:
            c.close()
        self._conns = []
        self._listener.close()

    def __enter__(self) -> "TrainerGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


async def start_group(*args: Any, **kwargs: Any) -> TrainerGroup:
    """`TrainerGroup(*args, **kwargs)` in a thread, for the asyncio driver. When the awaiting task is
    cancelled (an RL run's SIGTERM), the start is cancelled too and waited for, and a group that was
    built anyway is closed, before CancelledError goes on: the teardown never waits on a start
    nobody will use, and no rank outlives the run. (A plain `asyncio.to_thread` would leave the
    thread waiting up to start_timeout_s and hand its group to nobody.)"""
    cancel = threading.Event()
    built = asyncio.get_running_loop().run_in_executor(None, lambda: TrainerGroup(*args, cancel=cancel, **kwargs))
    try:
        return await asyncio.shield(built)
    except asyncio.CancelledError:
        cancel.set()
        group = None
        with contextlib.suppress(Exception):
            group = await built
        if group is not None:
            await asyncio.to_thread(group.close)
        raise


def _service_method_name(method: Callable[..., Any]) -> str:
    owner, _, name = method.__qualname__.rpartition(".")
    if owner != "TrainerService" or name.startswith("_"):
        raise TypeError(f"{method.__qualname__} is not a public TrainerService method")
    return name


def _bind(method: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The call's arguments by name, as the rank will receive them (`self` left out); TypeError
    when they do not fit `method`'s signature."""
    bound = inspect.signature(method).bind(None, *args, **kwargs)
    return {k: v for k, v in list(bound.arguments.items())[1:]}


def die_with_parent() -> None:
    """Linux: SIGKILL the trainer if the driver dies, so no rank is orphaned."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

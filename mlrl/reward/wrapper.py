"""`AsyncRewardWrapper`: run a synchronous reward function in a process pool, awaitable, with a
timeout — the shape AReaL users know (`areal.api.reward_api.AsyncRewardWrapper`).

Why a process pool: reward functions are CPU-bound Python (sympy, regexes, code execution) and
would otherwise stall the event loop that drives every concurrent episode.

Invariants kept here:
- a reward call never raises into the workflow: an exception, a timeout, a non-numeric return
  or a dead pool gives 0.0, a warning, and a count in `RewardStats` (per wrapper, process-wide,
  and in the stats of the current episode when the episode runner collects them);
- a call that timed out cannot be cancelled inside a worker process, so the pool it ran in is
  replaced and its workers terminated; calls that were in flight on that pool are retried once on
  the new pool (they did nothing wrong);
- a function registered with `inline=True` (mlrl.reward.registry: pure and cheap, e.g.
  `exact_match`) is called in this thread, without the pool: its round trip would cost more than
  the function;
- a coroutine function (e.g. `reward_model`, which asks the judge's engines) is awaited on the
  event loop with the timeout, never sent to the pool; `score_many` runs its calls concurrently;
- pools are shared per (max_workers, start method) inside one process, like AReaL's, and use the
  `forkserver` start method by default: forking a process that holds tokenizer / HTTP / OpenMP
  threads can deadlock the child. Like vLLM's spawned engine, this re-imports the main script in
  the workers: training scripts need an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import inspect
import logging
import math
import multiprocessing
import os
import pickle
import secrets
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

from mlrl.metrics.timer import ACTIVITY
from mlrl.reward.registry import is_inline

logger = logging.getLogger(__name__)


@dataclass
class RewardStats:
    """Counters of reward calls (what the run's metrics report)."""

    calls: int = 0
    failures: int = 0   # the function raised, returned a non-number, or the pool died twice
    timeouts: int = 0
    first_error: str = field(default="", compare=False)  # what the first failure or timeout was

    def add(self, other: "RewardStats") -> None:
        self.calls += other.calls
        self.failures += other.failures
        self.timeouts += other.timeouts
        self.first_error = self.first_error or other.first_error

    @property
    def all_failed(self) -> bool:
        """Every reward call failed or timed out (each scored 0.0): nothing was scored."""
        return self.calls > 0 and self.failures + self.timeouts >= self.calls


GLOBAL_REWARD_STATS = RewardStats()
_CURRENT: contextvars.ContextVar[RewardStats | None] = contextvars.ContextVar("mlrl_reward_stats", default=None)


@contextlib.contextmanager
def collect_reward_stats() -> Iterator[RewardStats]:
    """Count the reward calls made in this context (the episode runner wraps each episode in it).

    Context variables follow asyncio tasks and `asyncio.to_thread`, so calls made by concurrent
    episodes are attributed to the right episode.
    """
    stats = RewardStats()
    token = _CURRENT.set(stats)
    try:
        yield stats
    finally:
        _CURRENT.reset(token)


def _count(name: str, why: str = "") -> None:
    for st in (GLOBAL_REWARD_STATS, _CURRENT.get()):
        if st is not None:
            setattr(st, name, getattr(st, name) + 1)
            st.first_error = st.first_error or why


def default_max_workers() -> int:
    """Half the cores, at least one (AReaL's heuristic without the per-GPU split)."""
    return max((os.cpu_count() or 1) // 2, 1)


def default_start_method() -> str:
    """`forkserver`, unless the main module is a file that does not exist (a script piped through
    stdin): forkserver/spawn children re-import the main module by path and would fail, so `fork`."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file and not os.path.exists(main_file):
        return "fork"
    return "forkserver"


class _PoolRegistry:
    """Process pools shared by all wrappers of one process, keyed by (max_workers, start method)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[tuple[int, str], ProcessPoolExecutor] = {}

    def get(self, key: tuple[int, str]) -> ProcessPoolExecutor:
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                from mlrl.reward.code import SCRATCH_ENV

                os.environ.setdefault(SCRATCH_ENV, secrets.token_hex(6))  # its workers inherit it
                pool = ProcessPoolExecutor(max_workers=key[0], mp_context=multiprocessing.get_context(key[1]))
                self._pools[key] = pool
            return pool

    def replace(self, key: tuple[int, str], old: ProcessPoolExecutor) -> None:
        """Retire `old` (killing its workers) unless someone already did."""
        with self._lock:
            if self._pools.get(key) is old:
                del self._pools[key]
        _terminate(old)

    def shutdown_all(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            _terminate(pool)


def _terminate(pool: ProcessPoolExecutor) -> None:
    # ProcessPoolExecutor has no public way to stop a running call before Python 3.14
    # (terminate_workers); a hung reward function would otherwise hold its worker forever.
    procs = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        with contextlib.suppress(Exception):
            p.terminate()
    if procs:  # off the caller's thread (often the event loop): waits for the workers to go
        threading.Thread(target=_reap, args=(procs,), name="mlrl-reward-reap", daemon=True).start()


def _reap(procs: list[Any]) -> None:
    """Wait for terminated workers (SIGKILL after 5 s), then remove what a killed worker could not:
    the code runner's scratch folders (mlrl.reward.code)."""
    from mlrl.reward.code import remove_scratch_of

    for p in procs:
        with contextlib.suppress(Exception):
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        with contextlib.suppress(Exception):
            remove_scratch_of(p.pid)


POOLS = _PoolRegistry()
atexit.register(POOLS.shutdown_all)


def _score_all(fn: Callable[..., Any], calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> list[tuple[bool, Any]]:
    """Runs in the reward worker: every call, each failure kept to itself as (False, description)."""
    out: list[tuple[bool, Any]] = []
    for args, kwargs in calls:
        try:
            out.append((True, fn(*args, **kwargs)))
        except Exception as e:  # reported per call by score_many
            out.append((False, f"raised {type(e).__name__}: {e}"))
    return out


class AsyncRewardWrapper:
    """Awaitable wrapper of a synchronous reward function `fn(*args, **kwargs) -> float`.

    `max_workers=None` picks half the cores; `max_workers=0` runs the function in a thread of
    this process instead (for functions that cannot be pickled or are trivially cheap: the
    timeout still returns 0.0, but the thread keeps running until the function returns).
    `timeout_seconds` is accepted as an alias of `timeout` (AReaL's name).
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        timeout: float = 15.0,
        max_workers: int | None = None,
        *,
        timeout_seconds: float | None = None,
        mp_context: str | None = None,
        name: str | None = None,
    ):
        if isinstance(reward_fn, AsyncRewardWrapper):
            reward_fn = reward_fn.reward_fn
        if not callable(reward_fn):
            raise TypeError(f"AsyncRewardWrapper: reward_fn must be callable, got {type(reward_fn).__name__}")
        self.reward_fn = reward_fn
        self.timeout = float(timeout_seconds if timeout_seconds is not None else timeout)
        if self.timeout <= 0:
            raise ValueError(f"AsyncRewardWrapper: timeout must be > 0 seconds, got {self.timeout}")
        self.max_workers = default_max_workers() if max_workers is None else int(max_workers)
        if self.max_workers < 0:
            raise ValueError(f"AsyncRewardWrapper: max_workers must be >= 0, got {self.max_workers}")
        self.name = name or getattr(reward_fn, "__qualname__", repr(reward_fn))
        self.stats = RewardStats()
        self._key = (self.max_workers, mp_context or default_start_method())
        self.inline = is_inline(reward_fn)  # called here, no pool (register_reward(inline=True))
        self.is_async = inspect.iscoroutinefunction(reward_fn)  # awaited on the event loop, no pool
        if self.max_workers > 0 and not self.inline and not self.is_async:
            try:
                pickle.dumps(reward_fn)
            except Exception as e:
                raise ValueError(
                    f"reward function {self.name!r} cannot be pickled for the reward process pool ({e}); "
                    "define it at module level, or pass max_workers=0 to run it in a thread"
                ) from None

    @property
    def timeout_seconds(self) -> float:
        return self.timeout

    def _bump(self, name: str, why: str = "") -> None:
        """Count a call, failure or timeout; `why` (a failure's or timeout's message, the first one
        kept) names it in the run's stop message when every reward call of a step fails."""
        setattr(self.stats, name, getattr(self.stats, name) + 1)
        self.stats.first_error = self.stats.first_error or why
        _count(name, why)

    async def __call__(self, *args: Any, **kwargs: Any) -> float:
        with ACTIVITY.busy("reward"):  # timing/reward (mlrl.metrics.timer)
            return await self._call(*args, **kwargs)

    async def _run(self, job: Callable[[], Any], timeout: float) -> tuple[str, Any]:
        """Run `job` on the executor (the shared process pool, or a thread with max_workers=0):
        ("ok", value), ("timeout", None), ("broken", None) after the pool broke twice (it is
        replaced and the job retried once), or ("raised", exception). A timed-out pool is
        replaced, so the stuck worker does not block later calls. An inline function is called
        here: ("ok", value) or ("raised", exception), no timeout."""
        if self.inline:
            try:
                return "ok", job()
            except Exception as e:  # the user's function raised
                return "raised", e
        for attempt in range(2):
            pool = None
            try:
                if self.max_workers == 0:
                    fut = asyncio.get_running_loop().run_in_executor(None, contextvars.copy_context().run, job)
                else:
                    pool = POOLS.get(self._key)
                    fut = asyncio.get_running_loop().run_in_executor(pool, job)
                return "ok", await asyncio.wait_for(fut, timeout=timeout)
            except (TimeoutError, asyncio.TimeoutError):
                if pool is not None:
                    POOLS.replace(self._key, pool)
                return "timeout", None
            except BrokenProcessPool:
                if pool is not None:
                    POOLS.replace(self._key, pool)
                if attempt == 0:
                    continue
                return "broken", None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the user's function raised (re-raised here by the pool)
                return "raised", e
        return "broken", None  # unreachable

    async def _await(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any]:
        """A coroutine reward function, awaited here with the timeout: ("ok", value), ("timeout",
        None) or ("raised", exception)."""
        try:
            call = cast("Coroutine[Any, Any, Any]", self.reward_fn(*args, **kwargs))  # is_async: a coroutine
            return "ok", await asyncio.wait_for(call, timeout=self.timeout)
        except (TimeoutError, asyncio.TimeoutError):
            return "timeout", None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the user's function raised
            return "raised", e

    async def _call(self, *args: Any, **kwargs: Any) -> float:
        self._bump("calls")
        if self.is_async:
            status, value = await self._await(args, kwargs)
        else:
            status, value = await self._run(partial(self.reward_fn, *args, **kwargs), self.timeout)
        if status == "timeout":
            why = f"reward {self.name} timed out after {self.timeout:.1f}s"
            self._bump("timeouts", why)
            logger.warning("%s; reward 0.0", why)
            return 0.0
        if status == "broken":
            why = f"reward {self.name}: process pool broke twice"
            self._bump("failures", why)
            logger.warning("%s; reward 0.0", why)
            return 0.0
        if status == "raised":
            why = f"reward {self.name} raised {type(value).__name__}: {value}"
            self._bump("failures", why)
            logger.warning("%s; reward 0.0", why)
            return 0.0
        score = _finite(value)
        if score is None:
            why = f"reward {self.name} returned {value!r} (expected a finite number)"
            self._bump("failures", why)
            logger.warning("%s; reward 0.0", why)
            return 0.0
        return score

    async def score_many(self, calls: Sequence[tuple[tuple[Any, ...], dict[str, Any]]]) -> list[float]:
        """Score several completions, `calls` = [(args, kwargs), ...], in ONE executor task: one
        process-pool round trip instead of one per call (for a cheap reward the round trip is
        most of the cost; a GRPO group scores its n samples this way). Each call keeps its own
        outcome: one that raises or returns a non-number scores 0.0 and counts as a failure. The
        batch gets len(calls) x timeout; when that runs out, every call of it scores 0.0 and
        counts as a timeout."""
        if not calls:
            return []
        if self.is_async:  # each call its own task and timeout; the engines batch them
            with ACTIVITY.busy("reward"):
                return list(await asyncio.gather(*(self._call(*a, **k) for a, k in calls)))
        with ACTIVITY.busy("reward"):
            for _ in calls:
                self._bump("calls")
            job = partial(_score_all, self.reward_fn, [(tuple(a), dict(k)) for a, k in calls])
            budget = self.timeout * len(calls)
            status, outcomes = await self._run(job, budget)
            if status != "ok":
                why = (f"reward {self.name}: {len(calls)} calls "
                       + (f"timed out after {budget:.1f}s" if status == "timeout" else f"failed ({status})"))
                for _ in calls:
                    self._bump("timeouts" if status == "timeout" else "failures", why)
                logger.warning("%s; reward 0.0", why)
                return [0.0] * len(calls)
            out = []
            for ok, value in outcomes:
                if ok:
                    score = _finite(value)
                    if score is not None:
                        out.append(score)
                        continue
                    value = f"returned {value!r} (expected a finite number)"
                why = f"reward {self.name}: {value}"
                self._bump("failures", why)
                logger.warning("%s; reward 0.0", why)
                out.append(0.0)
            return out

    @staticmethod
    def shutdown_pools() -> None:
        """Terminate every shared reward pool of this process (tests, end of run)."""
        POOLS.shutdown_all()


def _finite(value: Any) -> float | None:
    """A reward's value as a float, or None when it is not a finite number (a NaN would make its
    whole group's advantages NaN; it scores 0.0 and counts as a failure instead)."""
    try:
        score = float(value)
    except (TypeError, ValueError):
        return None
    return score if math.isfinite(score) else None

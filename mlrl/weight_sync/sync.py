"""`WeightSync.sync(version) -> SyncReport`: one verified weight sync of every live engine.

The loop calls only `await weight_sync.sync(version)`; the transport (broadcast / disk / CUDA
IPC, see mlrl.weight_sync.transports) is chosen once by `mlrl.weight_sync.registry.make_weight_sync`.
This module is the transport-independent half: the `WeightSync` base class (pause, verify, canary,
retry, commit), its report and the facts it is built from (`SyncSetup`). The pool and its engines
are seen only through the Protocols of mlrl.interfaces (`RolloutPool`, `EngineHandle`).

Order of one sync (the same for every transport):
    pool.pause()            in-flight requests finish first or are interrupted (rollout.interrupt_on_sync);
                            the engines are idle and paused (vLLM /pause) — updates never race generation
    [hooks.before_transfer] colocated placement (mlrl.colocation): engine weights awake, trainer params resident
    canary reference        the trainer's logprobs of a fixed token sequence (`source.canary_logprobs`);
                            it needs only the trainer, so it runs off the critical path: during the pause,
                            or, when the pool was already paused (the sync loop pauses the idle engines
                            while the trainer trains), as soon as the trainer's part of the transfer
                            returned, while the engines still load and finish. With hooks: here.
    transfer                start -> receive + load -> finish(version) on every engine (transport-specific)
    [hooks.before_verify]   colocated: trainer params may be offloaded, engines get their KV cache back
    verify checksums        each worker's per-sender (tensor count, bytes, digest) == the sender's report,
                            and no model parameter was left without a tensor
    reset prefix caches     KV computed with the old weights must never be reused
    canary                  engines resumed (pool still closed): the engines' logprobs of the canary
                            sequence vs the trainer's, max |diff| <= canary_tolerance
    commit + pool.resume()  the pool's version becomes `version`; interrupted requests continue
A failed transfer, checksum or canary check is retried once (a broadcast group is rebuilt);
a second failure raises `WeightSyncError` and leaves the pool paused: training must not go on
against engines whose weights are not the trainer's.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Iterable, Iterator, Sequence

from mlrl.config.schema import WeightSyncConfig
from mlrl.interfaces import EngineControl, EngineHandle, RolloutPool, SyncHooks
from mlrl.weight_sync.source import PushRequest, SendReport, WeightSource

log = logging.getLogger(__name__)
CANARY_PROMPT, CANARY_COMPLETION = 8, 16


class WeightSyncError(RuntimeError):
    """A sync failed twice (transfer, checksum or canary); the message says which check and by how much."""


class _Mismatch(Exception):
    """One attempt's verification failed (retried once)."""


@dataclass
class SyncReport(Mapping):
    """Outcome of one sync. Also a read-only mapping of metrics ("weight_sync/<name>" -> float)."""

    version: int
    transport: str
    engines: int = 0
    tensors: int = 0
    bytes: int = 0
    attempts: int = 1
    seconds: float = 0.0           # pause -> resume
    pause_s: float = 0.0           # draining / interrupting in-flight requests
    transfer_s: float = 0.0        # start -> finish on the engines (send + receive + load)
    verify_s: float = 0.0          # checksum comparison, prefix-cache reset, canary
    engine_apply_s: float = 0.0    # max over workers of vLLM's finalize (layer-wise processing + LM-head refresh)
    canary_max_abs_diff: float = 0.0
    canary_checked: bool = False   # weight_sync.canary_every: whether this sync ran the canary
    # max |engine canary logprob now - at the previous canary check of this process| (None: no
    # earlier check): evidence that the engines' policy changed, not only that it matches
    canary_moved: float | None = None
    sender_reports: list[SendReport] = field(default_factory=list, repr=False)
    engine_reports: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def metrics(self) -> dict[str, float]:
        rate = self.bytes / self.transfer_s if self.transfer_s > 0 else 0.0
        out = {f"weight_sync/{k}": float(v) for k, v in (
            ("version", self.version), ("seconds", self.seconds), ("pause_s", self.pause_s),
            ("transfer_s", self.transfer_s), ("verify_s", self.verify_s), ("engine_apply_s", self.engine_apply_s),
            ("bytes", self.bytes), ("bytes_per_s", rate), ("tensors", self.tensors), ("engines", self.engines),
            ("attempts", self.attempts), ("canary_checked", self.canary_checked))}
        if self.canary_checked:  # a sync that skipped the canary (weight_sync.canary_every) measured no gap
            out["weight_sync/canary_max_abs_diff"] = float(self.canary_max_abs_diff)
        if self.canary_moved is not None:
            out["weight_sync/canary_moved"] = float(self.canary_moved)
        return out

    def __getitem__(self, key: str) -> float:
        return self.metrics()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.metrics())

    def __len__(self) -> int:
        return len(self.metrics())


@dataclass(frozen=True)
class SyncSetup:
    """What a weight sync needs to know about the engines besides the pool (given by the caller,
    e.g. mlrl.jobs.rl from the config and the placement)."""

    model_dir: str | Path          # the engines' HF model folder: vocab_size for the canary prompt
    engine_tp: int = 1             # workers per engine (broadcast: receivers per engine)
    host: str = "127.0.0.1"        # address trainer ranks and engine workers reach this driver at (broadcast store)
    run_dir: str | Path | None = None  # disk: shards go to <run_dir>/weight_sync unless weight_sync.disk_dir is set
    backend: str | None = None     # broadcast: "gloo" / "nccl" (None: NCCL if this machine has CUDA, else gloo)


async def gather_all(aws: Iterable[Awaitable[Any]]) -> list[Any]:
    """`asyncio.gather`, but every call ends before the first failure is raised: a plain gather
    raises at once and leaves the other engines' calls running, into the retry's start (or past
    cuda_ipc's release of the handles they read)."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        raise failed
    return results


def engine_client(e: EngineHandle) -> EngineControl:
    """The control client of a live engine (the pool gives every started engine one)."""
    if e.client is None:
        raise RuntimeError(f"{e.name}: engine has no client (not started)")
    return e.client


def canary_tokens(vocab_size: int) -> tuple[list[int], list[int]]:
    """A fixed, model-independent token sequence spread over the vocabulary (prompt, completion)."""
    ids = [(11 + 7919 * i) % vocab_size for i in range(CANARY_PROMPT + CANARY_COMPLETION)]
    return ids[:CANARY_PROMPT], ids[CANARY_PROMPT:]


def verify_reports(
    senders: Sequence[SendReport],
    engines: Sequence[EngineHandle],
    reports: Sequence[list[dict[str, Any]]],
    version: int,
) -> tuple[int, int, float]:
    """Raise _Mismatch unless every worker of every engine received exactly what each sender sent.
    Returns (tensors, bytes, max finalize seconds)."""
    by_sender = {r.sender: r for r in senders}
    apply_s = 0.0
    for e, workers in zip(engines, reports):
        if not workers:
            raise _Mismatch(f"{e.name}: no weight report from its workers")
        for w in workers:
            if not isinstance(w, dict) or w.get("version") != version:
                raise _Mismatch(
                    f"{e.name}: worker report is for version {w.get('version') if isinstance(w, dict) else w!r}, "
                    f"expected {version}"
                )
            if w.get("missing"):
                raise _Mismatch(
                    f"{e.name} worker {w.get('worker')}: {len(w['missing'])} parameters received no tensor, e.g. "
                    f"{w['missing'][:5]}"
                )
            streams = {s["sender"]: s for s in w.get("streams", [])}
            if set(streams) != set(by_sender):
                raise _Mismatch(
                    f"{e.name} worker {w.get('worker')}: streams from senders {sorted(streams)}, expected "
                    f"{sorted(by_sender)}"
                )
            for s, sent in by_sender.items():
                got = streams[s]
                if (got["tensors"], got["bytes"], got["digest"]) != (sent.tensors, sent.bytes, sent.digest):
                    raise _Mismatch(
                        f"{e.name} worker {w.get('worker')}: from sender {s} received {got['tensors']} tensors / "
                        f"{got['bytes']} bytes / digest {got['digest'][:12]}, sent {sent.tensors} / {sent.bytes} / "
                        f"{sent.digest[:12]}"
                    )
            apply_s = max(apply_s, float(w.get("finalize_s", 0.0)))
    return sum(r.tensors for r in senders), sum(r.bytes for r in senders), apply_s


class WeightSync(abc.ABC):
    """Pushes the trainer's weights into every live engine of the pool, verified. Subclasses
    (mlrl.weight_sync.transports) implement `_transfer`; all take `(cfg, pool, source, setup)`."""

    transport: str = ""

    def __init__(self, cfg: WeightSyncConfig, pool: RolloutPool, source: WeightSource, setup: SyncSetup) -> None:
        if cfg.bucket_mb <= 0:
            raise ValueError(f"weight_sync.bucket_mb must be > 0, got {cfg.bucket_mb}")
        self.cfg = cfg
        # mlrl.jobs.rl resolves the tolerance by model.dtype; built directly, unset means float32's
        self.tolerance = cfg.canary_tolerance_for("float32")
        self.pool = pool
        self.source = source
        self.bucket_bytes = int(cfg.bucket_mb * (1 << 20))
        self._lock = asyncio.Lock()
        self.setup = setup
        cfg_json = json.loads((Path(setup.model_dir) / "config.json").read_text())
        vocab = int(cfg_json.get("vocab_size") or cfg_json.get("text_config", {}).get("vocab_size", 0))
        if vocab <= 0:
            raise ValueError(f"{setup.model_dir}/config.json has no vocab_size (needed for the canary prompt)")
        self.canary = canary_tokens(vocab)
        self.history: list[SyncReport] = []
        # the canary reference of the current attempt, when it waits for the trainer's push (`_push`)
        self._after_push: asyncio.Task | None = None
        self._reference_after_push = False
        self._last_canary: list[float] | None = None  # the engines' canary logprobs at the last check

    @abc.abstractmethod
    async def _transfer(
        self, version: int, engines: Sequence[EngineHandle]
    ) -> tuple[list[SendReport], list[list[dict[str, Any]]]]:
        """Move the weights into `engines` and finish the update with `version` (paused engines);
        return the senders' reports and each engine's per-worker reports."""

    async def _push(self, request: PushRequest) -> list[SendReport]:
        """The trainer's part of a transfer (`source.push`, in a worker thread, never holding the
        event loop). Transports call this rather than `source.push`: once the trainer returns, a
        deferred canary reference starts while the engines are still loading and finishing."""
        reports = await asyncio.to_thread(self.source.push, request)
        if self._reference_after_push and self._after_push is None:
            self._after_push = asyncio.create_task(self._canary_reference())
        return reports

    async def _after_failure(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Reset transport state after a failed attempt (e.g. tear down a broadcast group)."""

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release transport resources (groups, files kept for restarts)."""

    async def refresh(self) -> None:
        """A full sync to the pool's current version: the pool's `refresher` hook (wired by the caller,
        e.g. mlrl.jobs.rl), so that an engine restarted after a crash serves the current weights again."""
        await self.sync(self.pool.version)

    async def sync(self, version: int, hooks: SyncHooks | None = None) -> SyncReport:
        """`hooks` (colocated placement, mlrl.colocation): `before_transfer` runs before each attempt's
        transfer (engine weights awake, trainer parameters on the device), `before_verify` after it
        (trainer parameters may leave, the engines' KV cache comes back for the canary)."""
        async with self._lock:
            t0 = time.perf_counter()
            # the canary on every canary_every-th version, the first sync and every refresh / retry
            canary = self.tolerance > 0 and (
                not self.history or version % max(1, self.cfg.canary_every) == 0 or version == self.pool.version)
            # the trainer's canary logprobs need only the trainer: they are computed while the engines
            # drain and pause (vLLM's pause alone sleeps 20 ms), or, when the pool is already paused
            # (nothing to overlap), right after the trainer's push (`_push`). Not with hooks: the
            # colocated trainer's parameters come back in `before_transfer`.
            after_push = canary and hooks is None and self.pool.paused
            early = canary and hooks is None and not after_push
            reference = asyncio.create_task(self._canary_reference()) if early else None
            try:
                await self.pool.pause()
            except BaseException:
                if reference is not None:
                    reference.cancel()
                    await asyncio.gather(reference, return_exceptions=True)
                raise
            rep = SyncReport(version=version, transport=self.transport, pause_s=time.perf_counter() - t0)
            last: BaseException | None = None
            for attempt in (1, 2):
                rep.attempts = attempt
                engines = self.pool.live_engines()
                chosen = {e.index: e.incarnation for e in engines}  # a restart meanwhile: not this version
                if not engines:
                    if reference is not None:
                        reference.cancel()
                    raise WeightSyncError("weight sync: no live engine to update")
                try:
                    await self._attempt(version, engines, rep, hooks, canary=canary or attempt > 1,
                                        reference=reference if attempt == 1 else None,
                                        after_push=after_push and attempt == 1)
                    break
                except Exception as err:  # retried once, then raised with the first cause
                    last = err
                    log.warning("weight sync v%d attempt %d failed: %s", version, attempt, err)
                    await self._after_failure()
                    await asyncio.gather(
                        *(engine_client(e).pause("wait") for e in self.pool.live_engines()), return_exceptions=True
                    )
            else:
                raise WeightSyncError(
                    f"weight sync to version {version} ({self.transport}) failed twice; engines left paused. "
                    f"Last error: {type(last).__name__}: {last}"
                ) from last
            self.pool.commit_version(version, engines, incarnations=chosen)
            await self.pool.resume()
            rep.seconds = time.perf_counter() - t0
            self.history.append(rep)
            return rep

    async def check_loaded(self, version: int, hooks: SyncHooks | None = None) -> SyncReport | None:
        """The first sync of a run whose engines loaded the trainer's own starting weights (a fresh
        run from model.hf_dir, `weight_sync.first_sync=auto`): the canary alone, the trainer's
        logprobs of the canary sequence against each engine's; nothing is transferred. On success
        the engines hold `version` (report transport "loaded", 0 bytes). None when the canary is
        off (canary_tolerance <= 0) or disagrees (logged): the caller then runs `sync`. `hooks`
        (colocated) are called as a sync calls them: before_transfer, then the trainer's canary
        logprobs, then before_verify (its parameters may leave), then the engines' canary."""
        if self.tolerance <= 0:
            return None
        async with self._lock:
            t0 = time.perf_counter()
            engines = self.pool.live_engines()
            chosen = {e.index: e.incarnation for e in engines}
            if not engines:
                raise WeightSyncError("weight sync: no live engine to check")
            if hooks is not None:
                await hooks.before_transfer()
            want = await self._canary_reference()
            if hooks is not None:
                await hooks.before_verify()
            diff, got = await self._canary(engines, want)
            if diff > self.tolerance:
                log.warning("first sync: the engines' canary logprobs differ from the trainer's by %.3g > %g; "
                            "pushing the weights", diff, self.tolerance)
                return None
            self._last_canary = got
            self.pool.commit_version(version, engines, pushed=False, incarnations=chosen)  # their own load, checked
            rep = SyncReport(version=version, transport="loaded", engines=len(engines), canary_max_abs_diff=diff,
                             canary_checked=True, seconds=time.perf_counter() - t0)
            rep.verify_s = rep.seconds
            self.history.append(rep)
            return rep

    async def _attempt(self, version: int, engines: Sequence[EngineHandle], rep: SyncReport,
                       hooks: SyncHooks | None = None, *, canary: bool = True,
                       reference: asyncio.Task | None = None, after_push: bool = False) -> None:
        """`reference`: the trainer's canary logprobs, already started by `sync`; `after_push`: they
        start once the trainer's push returned (`_push`); else they are computed here, first."""
        # the trainer's canary logprobs before the transfer unless started elsewhere: with hooks the
        # trainer's parameters may be offloaded before the engines are checked
        if hooks is not None:
            await hooks.before_transfer()
        t = time.perf_counter()
        want = None
        if reference is not None:
            want = await reference
        elif canary and not after_push:
            want = await self._canary_reference()
        reference_s = time.perf_counter() - t
        t = time.perf_counter()
        self._after_push, self._reference_after_push = None, after_push
        try:
            senders, reports = await self._transfer(version, engines)
        except BaseException:
            await self._drop_after_push()  # never leave a trainer call running into the retry
            raise
        finally:
            self._reference_after_push = False
        rep.transfer_s = time.perf_counter() - t
        if after_push:
            t = time.perf_counter()
            task, self._after_push = self._after_push, None  # None: the transport did not go through `_push`
            want = await (task if task is not None else self._canary_reference())
            reference_s += time.perf_counter() - t
        rep.canary_checked = want is not None
        if hooks is not None:
            await hooks.before_verify()
        t = time.perf_counter()
        # with verify_checksums off the digests cover names only; counts, bytes and completeness are still checked
        rep.tensors, rep.bytes, rep.engine_apply_s = verify_reports(senders, engines, reports, version)
        ok = await asyncio.gather(*(engine_client(e).reset_prefix_cache() for e in engines))
        if not all(ok):
            raise _Mismatch(
                f"prefix cache reset refused by {[e.name for e, k in zip(engines, ok) if not k]} (requests still "
                "hold blocks)"
            )
        # the pool stays closed: only the canary runs
        await asyncio.gather(*(engine_client(e).resume() for e in engines))
        if want is not None:
            rep.canary_max_abs_diff, got = await self._canary(engines, want)
            if self._last_canary is not None:
                rep.canary_moved = max(abs(a - b) for a, b in zip(got, self._last_canary))
            if rep.canary_max_abs_diff > self.tolerance:
                raise _Mismatch(f"canary logprobs differ from the trainer's by {rep.canary_max_abs_diff:.3g} "
                                f"> weight_sync.canary_tolerance={self.tolerance:g}")
            self._last_canary = got
        rep.engines = len(engines)
        rep.sender_reports, rep.engine_reports = senders, [w for ws in reports for w in ws]
        rep.verify_s = time.perf_counter() - t + reference_s

    async def _drop_after_push(self) -> None:
        task, self._after_push = self._after_push, None
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    async def _canary_reference(self) -> list[float]:
        prompt, completion = self.canary
        want = await asyncio.to_thread(self.source.canary_logprobs, prompt, completion)
        if len(want) != len(completion):
            raise _Mismatch(f"source.canary_logprobs returned {len(want)} values for {len(completion)} tokens")
        return want

    async def _canary(self, engines: Sequence[EngineHandle], want: list[float]) -> tuple[float, list[float]]:
        """Max |engine - trainer| over the canary's completion tokens and engines (inf when any is
        not finite: max() would pass over a NaN, and a NaN is never within a tolerance); the
        first engine's logprobs of them."""
        prompt, completion = self.canary
        got = await asyncio.gather(*(engine_client(e).prompt_logprobs(prompt + completion) for e in engines))
        diffs = [abs(a - b) for g in got for a, b in zip(g[-len(completion):], want)]
        worst = math.inf if not all(math.isfinite(d) for d in diffs) else max(diffs)
        return worst, got[0][-len(completion):]


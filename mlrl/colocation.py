"""Colocated placement (cluster.placement=colocated): trainer ranks and vLLM engines time-share devices.

Start-up (mlrl.jobs.rl): the engines start first, alone on the devices (vLLM refuses to start
when less than rollout.gpu_memory_utilization of a GPU is free, and a trainer building beside its
profiling run would go out of memory), then sleep; only then do the trainer ranks build their
models (they were started and imported megatron meanwhile, held back by TrainerGroup's gate), so
the devices hold what the train phase below holds. `first_sync` then brings the engines to the
trainer's weights the way a step's sync does. Every state of the start is a phase of the step.

One synchronous step, as mlrl/loop.py drives it:

    rollout                       engines awake; the trainer holds only its parameters (or nothing:
                                  cluster.colocate.offload_params)
    to_trainer:  engines sleep    vLLM sleep mode, level cluster.colocate.sleep_level (1: weights to host
                                  memory, KV cache discarded; 2: both discarded, the sync rewrites them)
                 trainer reload   parameters (if offloaded), gradient buffers, optimizer state
    logprobs + train
    sync:        trainer offload  optimizer state + gradient buffers
                 wake "weights"   the engines' weights only (WeightSync hook: before each transfer)
                 transfer         trainer -> engines (CUDA IPC on GPU; any transport on CPU)
                 offload params   with offload_params (hook: after the transfer)
                 wake "kv_cache"  the engines resume scheduling; then the canary checks the weights
    eval, metrics; a checkpoint / HF export due at this step is deferred to the next step's
                 to_trainer (engines asleep, trainer resident), or done at once after the last step

Every sleep / wake goes through vLLM's own API (`/sleep`, `/wake_up?tags=`, `/is_sleeping`); an
engine is never restarted to free memory. Offload / reload are mlrl.trainer.rank.offload.

On CPU vLLM refuses sleep mode (`--enable-sleep-mode`: "Sleep mode is not supported on current
platform.") and its CPU worker ignores `/sleep` ("sleep mode is not supported on CPU, ignore it"):
the calls still pause scheduling and clear the prefix cache, the state machine and the trainer's
offload run as on GPU, and `colocate/engine_memory_released` = 0 says the engines kept their memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

from mlrl.config.schema import ColocateConfig
from mlrl.interfaces import Offloadable, RolloutPool, SyncHooks, WeightSync
from mlrl.metrics import StepTimer

log = logging.getLogger(__name__)
TRAIN_STATE = ["optimizer", "grads"]  # always offloaded while the engines run
R = TypeVar("R")


class Colocation:
    """The colocated state machine between a trainer (`Offloadable`) and the engine pool. `trainer`
    may come later (`attach`): at start-up the engines sleep before the trainer exists."""

    def __init__(self, cfg: ColocateConfig, trainer: Offloadable | None, pool: RolloutPool, *,
                 engine_memory_released: bool) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.pool = pool
        self.engine_memory_released = engine_memory_released
        self.timer: StepTimer | None = None
        self.engines_asleep = False
        self.kv_asleep = False
        self.params_out = False
        self.trainer_out = False
        self.metrics: dict[str, float] = {}
        if not engine_memory_released:
            log.warning("cluster.placement=colocated without CUDA: the engines get vLLM's sleep / wake calls "
                        "(scheduling pauses, prefix cache cleared) but keep their memory (vLLM's CPU build has no "
                        "sleep mode); the trainer's offload / reload runs for real")

    # ---- timing ------------------------------------------------------------------------------------
    def _time(self, name: str, seconds: float) -> None:
        if self.timer is not None:
            self.timer.add(name, seconds)
        self.metrics[f"colocate/{name}_s"] = self.metrics.get(f"colocate/{name}_s", 0.0) + seconds

    def _bytes(self, prefix: str, report: dict[str, float]) -> None:
        for kind in ("params", "grads", "optimizer"):
            if kind in report:
                key = f"colocate/{prefix}_bytes/{kind}"
                self.metrics[key] = self.metrics.get(key, 0.0) + report[kind]
        # copied: what the offloader moved; measured: what the devices' allocators saw leave (offload) or
        # come back (reload), independent of the offloader's own byte counts (0 on CPU)
        for what in ("copied", "measured"):
            key = f"colocate/{prefix}_{what}_bytes"
            self.metrics[key] = self.metrics.get(key, 0.0) + report.get(what, 0.0)

    # ---- engines -----------------------------------------------------------------------------------
    async def _engines(self, what: str, call) -> None:
        t0 = time.perf_counter()
        await asyncio.gather(*(call(e.client) for e in self.pool.live_engines() if e.client is not None))
        self._time(what, time.perf_counter() - t0)

    async def sleep_engines(self) -> None:
        if self.engines_asleep:
            return
        await self._engines("sleep", lambda c: c.sleep(self.cfg.sleep_level, "wait"))
        self.engines_asleep = self.kv_asleep = True

    async def wake_engines(self, tag: str) -> None:
        """Wake "weights" (then the sync writes them) or "kv_cache" (then the engines schedule again)."""
        if not (self.engines_asleep if tag == "weights" else self.kv_asleep):
            return
        await self._engines("wake", lambda c: c.wake_up([tag]))
        self.engines_asleep = False
        if tag == "kv_cache":
            self.kv_asleep = False

    # ---- trainer -----------------------------------------------------------------------------------
    def attach(self, trainer: Offloadable) -> None:
        self.trainer = trainer

    def _trainer(self) -> Offloadable:
        if self.trainer is None:
            raise RuntimeError("colocation: no trainer attached yet")
        return self.trainer

    async def offload(self, kinds: list[str]) -> None:
        t0 = time.perf_counter()
        rep = await asyncio.to_thread(self._trainer().offload, kinds)
        self._time("offload", time.perf_counter() - t0)
        self._bytes("offload", rep)
        self.trainer_out = True
        self.params_out = self.params_out or "params" in kinds

    async def reload(self, kinds: list[str] | None = None) -> None:
        """Bring back what left the devices (`kinds`: only those)."""
        if not self.trainer_out:
            return
        t0 = time.perf_counter()
        rep = await asyncio.to_thread(self._trainer().reload, kinds)
        self._time("reload", time.perf_counter() - t0)
        self._bytes("reload", rep)
        if kinds is None:
            self.trainer_out = self.params_out = False
        elif "params" in kinds:
            self.params_out = False

    # ---- the step's transitions --------------------------------------------------------------------
    async def first_sync(self, check: Callable[[SyncHooks], Awaitable[R | None]] | None,
                         push: Callable[[SyncHooks], Awaitable[R]]) -> R:
        """The run's first sync, the engines asleep since their start and the trainer built beside
        them (the train phase): its optimizer state and gradients leave; then either `check`
        (WeightSync.check_loaded: the canary alone) confirms the weights the engines loaded
        themselves, or `push` (WeightSync.sync) moves the trainer's weights. Both call these hooks
        as a step's sync does (wake weights, [transfer,] offload params, wake the KV cache, canary),
        so the devices go through the sync phase into the rollout phase. `check` needs the engines'
        own weights back from their sleep: level 1 (kept in host memory), or no release (CPU). A
        check that disagrees (the check logs it) puts the engines back to sleep before the push, so
        the push too goes through the sync phase, not the rollout phase plus the transfer."""
        await self.offload(TRAIN_STATE)
        report = await check(self) if check is not None else None
        if report is None:
            if check is not None:
                await self.sleep_engines()
            report = await push(self)
        self.metrics.clear()
        return report

    async def to_trainer(self, timer: StepTimer | None) -> None:
        """Rollout done: engines sleep, the trainer's state comes back."""
        self.timer = timer
        await self.sleep_engines()
        await self.reload()

    async def sync(self, weight_sync: WeightSync, version: int, timer: StepTimer) -> dict[str, Any]:
        """Training done: the trainer's optimizer / gradients leave, the engines wake and receive the
        new weights (`before_transfer` / `before_verify` run inside the sync). Returns the sync's
        metrics and the step's colocate/* metrics."""
        self.timer = timer
        await self.offload(TRAIN_STATE)
        hooks_before = sum(v for k, v in self.metrics.items() if k.endswith("_s"))
        t0 = time.perf_counter()
        report = await weight_sync.sync(version, hooks=self)
        hooks_s = sum(v for k, v in self.metrics.items() if k.endswith("_s")) - hooks_before
        timer.add("sync", time.perf_counter() - t0 - hooks_s)
        out = {**report, **self.step_metrics()}
        self.metrics.clear()
        return out

    async def before_transfer(self) -> None:
        if self.params_out:  # a retried attempt after the parameters left: bring them back, only them (the
            await self.reload(["params"])  # engines' KV cache is awake by then: the train state stays out)
        await self.wake_engines("weights")

    async def before_verify(self) -> None:
        if self.cfg.offload_params:
            await self.offload(["params"])
        await self.wake_engines("kv_cache")

    def step_metrics(self) -> dict[str, float]:
        # the seconds are the step's timing/sleep, /wake, /offload, /reload
        out = {k: v for k, v in self.metrics.items() if not k.endswith("_s")}
        return {**out, "colocate/sleep_level": float(self.cfg.sleep_level),
                "colocate/engine_memory_released": float(self.engine_memory_released)}

"""The colocated state machine (mlrl.colocation) with recording doubles of its neighbours: the
trainer (offload / reload), the engines' sleep API and a weight sync that calls the hooks the way
mlrl.weight_sync.WeightSync does. The real engines, trainer and sync run in
tests/integration/loop/test_colocated_run.py and tests/integration/trainer/test_offload.py."""

import asyncio
from dataclasses import dataclass

import pytest

from mlrl.colocation import Colocation
from mlrl.config.schema import ColocateConfig
from mlrl.metrics import StepTimer

WAKE_S = 0.02
BYTES = {"params": 100.0, "grads": 50.0, "optimizer": 200.0}


class Trainer:
    def __init__(self, calls):
        self.calls, self.out = calls, set()

    def offload(self, kinds):
        new = [k for k in kinds if k not in self.out]
        self.out |= set(new)
        self.calls.append(("offload", tuple(kinds)))
        rep = {k: BYTES[k] for k in new}
        # measured: what a device saw leave; here a little more than counted (allocator block rounding)
        return {**rep, "copied": sum(v for k, v in rep.items() if k != "grads"), "measured": sum(rep.values()) + 1.0,
                "seconds": 0.0}

    def reload(self, kinds=None):
        back = set(self.out) if kinds is None else self.out & set(kinds)
        rep = {k: BYTES[k] for k in back}
        self.out -= back
        self.calls.append(("reload",) if kinds is None else ("reload", tuple(kinds)))
        return {**rep, "copied": sum(v for k, v in rep.items() if k != "grads"), "seconds": 0.0}


class Client:
    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    async def sleep(self, level=1, mode="wait"):
        self.calls.append((self.name, "sleep", level))

    async def wake_up(self, tags=None):
        self.calls.append((self.name, "wake", tuple(tags or ())))
        await asyncio.sleep(WAKE_S)
        return tags is None or "kv_cache" in tags


@dataclass
class Handle:
    client: Client


class Pool:
    def __init__(self, calls, n=2):
        self.engines = [Handle(Client(calls, f"e{i}")) for i in range(n)]

    def live_engines(self):
        return self.engines


class Sync:
    """Calls the hooks around a transfer, `attempts` times (a failed first attempt is retried)."""

    def __init__(self, calls, attempts=1):
        self.calls, self.attempts = calls, attempts

    async def sync(self, version, hooks=None):
        for _ in range(self.attempts):
            await hooks.before_transfer()
            self.calls.append(("transfer", version))
            await hooks.before_verify()
        self.calls.append(("canary", version))
        return {"weight_sync/version": float(version)}


def _machine(offload_params=False, level=1, attempts=1):
    calls = []
    colo = Colocation(ColocateConfig(sleep_level=level, offload_params=offload_params), None, Pool(calls),
                      engine_memory_released=False)
    return colo, calls, Sync(calls, attempts)


async def _start(colo, calls, sync, check=None):
    """mlrl.jobs.rl's colocated start-up: the engines started alone and sleep, then the trainer is
    built (attached) and the first sync runs."""
    await colo.sleep_engines()
    colo.attach(Trainer(calls))
    return await colo.first_sync(check, lambda hooks: sync.sync(0, hooks=hooks))


async def _step(colo, sync, version=1):
    timer = StepTimer()
    await colo.to_trainer(timer)
    return timer, await colo.sync(sync, version, timer)


@pytest.mark.parametrize("offload_params", [False, True])
async def test_one_step_in_order(offload_params):
    colo, calls, sync = _machine(offload_params=offload_params)
    await _start(colo, calls, sync)
    # start-up: the engines sleep before the trainer exists; the first sync is a step's sync
    start = [("e0", "sleep", 1), ("e1", "sleep", 1), ("offload", ("optimizer", "grads")),
             ("e0", "wake", ("weights",)), ("e1", "wake", ("weights",)), ("transfer", 0)]
    start += [("offload", ("params",))] if offload_params else []
    start += [("e0", "wake", ("kv_cache",)), ("e1", "wake", ("kv_cache",)), ("canary", 0)]
    assert calls == start
    assert colo.trainer.out == ({"optimizer", "grads", "params"} if offload_params else {"optimizer", "grads"})
    calls.clear()
    timer, metrics = await _step(colo, sync)
    want = [("e0", "sleep", 1), ("e1", "sleep", 1), ("reload",),        # rollout done: engines sleep, trainer back
            ("offload", ("optimizer", "grads")),                         # trained: optimizer state + grads leave
            ("e0", "wake", ("weights",)), ("e1", "wake", ("weights",)),  # weights first
            ("transfer", 1)]
    want += [("offload", ("params",))] if offload_params else []          # params leave after the transfer
    want += [("e0", "wake", ("kv_cache",)), ("e1", "wake", ("kv_cache",)), ("canary", 1)]
    assert calls == want
    assert metrics["weight_sync/version"] == 1.0
    assert metrics["colocate/offload_bytes/optimizer"] == 200.0 and metrics["colocate/offload_bytes/grads"] == 50.0
    # the knob: parameters move (both ways) only with offload_params
    assert ("colocate/offload_bytes/params" in metrics) == offload_params
    assert ("colocate/reload_bytes/params" in metrics) == offload_params
    # the device's measurement is summed over the step's offloads (optimizer + grads, then params), apart
    # from the offloader's own counts
    assert metrics["colocate/offload_measured_bytes"] == 250.0 + 1.0 + (100.0 + 1.0 if offload_params else 0.0)
    assert metrics["colocate/engine_memory_released"] == 0.0 and metrics["colocate/sleep_level"] == 1.0
    assert {"sleep", "reload", "offload", "wake", "sync"} <= set(timer.totals)


async def test_sleep_level_reaches_the_engines():
    colo, calls, sync = _machine(level=2)
    await _start(colo, calls, sync)
    calls.clear()
    await _step(colo, sync)
    assert [c for c in calls if "sleep" in c] == [("e0", "sleep", 2), ("e1", "sleep", 2)]


async def test_a_retried_transfer_gets_the_parameters_back_first():
    colo, calls, sync = _machine(offload_params=True)
    await _start(colo, calls, sync)
    sync.attempts = 2  # this step's sync fails once
    calls.clear()
    await _step(colo, sync)
    second = calls[calls.index(("transfer", 1)) + 1:]
    # attempt 1 offloaded the params and woke the KV cache; attempt 2 reloads the params, and only them,
    # before transferring (the engines' KV cache is awake: the optimizer state and gradients stay out;
    # before, everything came back and was offloaded again)
    assert second[:5] == [("offload", ("params",)), ("e0", "wake", ("kv_cache",)), ("e1", "wake", ("kv_cache",)),
                          ("reload", ("params",)), ("transfer", 1)]
    assert colo.trainer.out == {"optimizer", "grads", "params"}  # after the retry's verify: all out again


async def test_sync_time_excludes_the_hooks():
    """The wakes run inside the weight sync; they are timing/wake, not timing/sync (the phases add up)."""
    colo, calls, sync = _machine()
    await _start(colo, calls, sync)
    timer, _ = await _step(colo, sync)
    assert timer.totals["wake"] >= 2 * WAKE_S  # weights, then KV cache
    assert timer.totals["sync"] < WAKE_S


def _check(calls, agrees=True):
    """WeightSync.check_loaded's calls: hooks around the trainer's canary logprobs, then the engines'."""

    async def check(hooks):
        await hooks.before_transfer()
        calls.append(("trainer canary",))
        await hooks.before_verify()
        calls.append(("engine canary",))
        return {"weight_sync/transport": "loaded"} if agrees else None

    return check


@pytest.mark.parametrize("offload_params", [False, True])
async def test_start_up_checks_the_weights_the_engines_loaded(offload_params):
    """A fresh run (weight_sync.first_sync=auto): the canary checks the engines' own load, nothing is
    transferred, and the devices go through a sync's phases: weights awake beside the trainer's
    parameters (no KV cache), then the parameters leave (offload_params) before the KV cache wakes."""
    colo, calls, sync = _machine(offload_params=offload_params)
    report = await _start(colo, calls, sync, _check(calls))
    want = [("e0", "sleep", 1), ("e1", "sleep", 1), ("offload", ("optimizer", "grads")),
            ("e0", "wake", ("weights",)), ("e1", "wake", ("weights",)), ("trainer canary",)]
    want += [("offload", ("params",))] if offload_params else []
    want += [("e0", "wake", ("kv_cache",)), ("e1", "wake", ("kv_cache",)), ("engine canary",)]
    assert calls == want
    assert report == {"weight_sync/transport": "loaded"}
    assert not colo.engines_asleep and not colo.kv_asleep and colo.params_out == offload_params
    assert colo.metrics == {}  # the start's bytes and seconds are not step 1's


async def test_start_up_pushes_when_the_check_disagrees():
    colo, calls, sync = _machine(offload_params=True)
    await _start(colo, calls, sync, _check(calls, agrees=False))
    after = calls[calls.index(("engine canary",)) + 1:]
    # the engines sleep again and the push runs as a step's sync: the parameters come back (only them),
    # the weights wake, the transfer, the parameters leave, the KV cache wakes
    assert after == [("e0", "sleep", 1), ("e1", "sleep", 1), ("reload", ("params",)), ("e0", "wake", ("weights",)),
                     ("e1", "wake", ("weights",)), ("transfer", 0), ("offload", ("params",)),
                     ("e0", "wake", ("kv_cache",)), ("e1", "wake", ("kv_cache",)), ("canary", 0)]
    assert colo.trainer.out == {"optimizer", "grads", "params"}


async def test_the_trainer_is_needed_only_once_it_offloads():
    colo, calls, _ = _machine()
    await colo.sleep_engines()  # at start-up, before the trainer exists
    with pytest.raises(RuntimeError, match="no trainer attached"):
        await colo.offload(["optimizer"])

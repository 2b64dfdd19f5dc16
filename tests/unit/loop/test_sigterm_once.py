"""SIGTERM cancels the run once: a second one (under Slurm, scancel signals the launcher step and
the batch script passes its own on) must not cancel the teardown the first one started (the RL
and evaluation jobs run under mlrl.jobs.rollout_parts.until_sigterm)."""

import asyncio
import os
import signal

import pytest

from mlrl.jobs.rollout_parts import until_sigterm


@pytest.mark.parametrize("signals", [1, 2, 3])
def test_repeated_sigterm_does_not_cut_the_teardown_short(signals):
    events: list[str] = []

    async def fake_run():
        try:
            events.append("running")
            await asyncio.sleep(30)
        finally:
            events.append("teardown started")
            for _ in range(signals - 1):   # more SIGTERMs arrive while tearing down
                os.kill(os.getpid(), signal.SIGTERM)
                await asyncio.sleep(0.05)
            events.append("teardown finished")

    async def main():
        terminated: list[bool] = []
        task = asyncio.ensure_future(until_sigterm(fake_run, terminated))
        await asyncio.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(asyncio.CancelledError):
            await task
        return terminated

    assert asyncio.run(main()) == [True]
    assert events == ["running", "teardown started", "teardown finished"]

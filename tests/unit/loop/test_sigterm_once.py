"""SIGTERM cancels the run once: a second one (under Slurm, scancel signals the launcher step and
the batch script passes its own on) must not cancel the teardown the first one started."""

import asyncio
import os
import signal

import pytest

from mlrl.jobs import rl as run_mod


@pytest.mark.parametrize("signals", [1, 2, 3])
def test_repeated_sigterm_does_not_cut_the_teardown_short(monkeypatch, signals):
    events: list[str] = []

    async def fake_run(cfg, layout, early):
        try:
            events.append("running")
            await asyncio.sleep(30)
        finally:
            events.append("teardown started")
            for _ in range(signals - 1):   # more SIGTERMs arrive while tearing down
                os.kill(os.getpid(), signal.SIGTERM)
                await asyncio.sleep(0.05)
            events.append("teardown finished")

    monkeypatch.setattr(run_mod, "_run", fake_run)

    async def main():
        terminated: list[bool] = []
        task = asyncio.ensure_future(run_mod._run_until_terminated(None, None, None, terminated))
        await asyncio.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(asyncio.CancelledError):
            await task
        return terminated

    assert asyncio.run(main()) == [True]
    assert events == ["running", "teardown started", "teardown finished"]

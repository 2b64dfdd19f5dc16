"""TrainerGroup's start is stoppable: a cancel (an RL run's SIGTERM, through `start_group`) or an
exception raised while it waits (an SFT run's SIGTERM handler) kills the ranks at once instead of
waiting start_timeout_s for them and leaving them to nobody. Stand-in rank processes (the spawn
hook Ray's placement uses) that never connect, so no torchrun is needed
(the last test runs a real torchrun, with a stand-in rank script)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import pytest

from mlrl.trainer.driver import group as group_mod
from mlrl.trainer.driver.group import TrainerError, TrainerGroup, start_group


class NeverConnect:
    """Rank processes that never call back (still importing megatron, say)."""

    def __init__(self) -> None:
        self.killed = threading.Event()

    def wait(self, timeout_s: float) -> bool:
        return self.killed.is_set()

    def kill(self) -> None:
        self.killed.set()

    def log_tail(self, lines: int = 40) -> str:
        return ""


def _spawner(made: list[NeverConnect]):
    def spawn(args: list[str], env: dict[str, str]) -> NeverConnect:
        made.append(NeverConnect())
        return made[-1]

    return spawn


def test_a_cancelled_start_kills_the_ranks_at_once(tmp_path: Path) -> None:
    made: list[NeverConnect] = []
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(TrainerError, match="cancelled with 0/2 ranks up"):
        TrainerGroup("x: 1\n", 2, run_dir=tmp_path, start_timeout_s=60, spawn=_spawner(made), cancel=cancel)
    assert time.monotonic() - t0 < 5  # not the 60 s start timeout
    assert made and made[0].killed.is_set()


def test_the_start_timeout_still_applies_without_a_cancel(tmp_path: Path) -> None:
    made: list[NeverConnect] = []
    with pytest.raises(TrainerError, match="only 0/1 ranks connected within 1 s"):
        TrainerGroup("x: 1\n", 1, run_dir=tmp_path, start_timeout_s=1, spawn=_spawner(made))
    assert made[0].killed.is_set()


class _Terminated(BaseException):
    pass


def test_an_exception_raised_while_waiting_kills_the_ranks(tmp_path: Path) -> None:
    """As the SFT / DPO SIGTERM handler does: it raises in the main thread, inside the wait."""
    made: list[NeverConnect] = []

    def on_alarm(*_: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(_Terminated):
            TrainerGroup("x: 1\n", 1, run_dir=tmp_path, start_timeout_s=60, spawn=_spawner(made))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert made[0].killed.is_set()


def test_start_group_cancelled_stops_the_start_and_returns_promptly(tmp_path: Path) -> None:
    made: list[NeverConnect] = []

    async def main() -> float:
        task = asyncio.create_task(start_group("x: 1\n", 1, run_dir=tmp_path, start_timeout_s=60,
                                               spawn=_spawner(made)))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - t0

    assert asyncio.run(main()) < 5  # the start thread is done: asyncio.run's executor shutdown does not wait
    assert made[0].killed.is_set()


def test_start_group_closes_a_group_built_while_it_was_cancelled(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancel came after the ranks were up: the built group is closed, not dropped."""
    closed = threading.Event()
    release = threading.Event()

    class Built:
        def __init__(self, *args: object, cancel: threading.Event, **kwargs: object) -> None:
            release.wait(5)  # finishes regardless of cancel

        def close(self) -> None:
            closed.set()

    monkeypatch.setattr(group_mod, "TrainerGroup", Built)

    async def main() -> None:
        task = asyncio.create_task(start_group("x: 1\n", 1, run_dir=tmp_path))
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.sleep(0.1)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert closed.is_set()


class ThreadRank:
    """A rank that connects at once and says hello when it gets the config (records when)."""

    def __init__(self, args: list[str], env: dict[str, str], events: list[tuple[str, float]]) -> None:
        from multiprocessing.connection import Client

        from mlrl.trainer.rpc import TOKEN_ENV, recv, send

        host, port = args[args.index("--connect") + 1].rsplit(":", 1)
        token = bytes.fromhex(env[TOKEN_ENV])

        def run() -> None:
            conn = Client((host, int(port)), authkey=token)
            events.append(("connected", time.monotonic()))
            try:
                recv(conn)  # the config
            except (EOFError, OSError):  # the driver gave up (cancelled) before sending it
                return
            events.append(("config", time.monotonic()))
            send(conn, {"rank": 0})
            while True:
                try:
                    if recv(conn)[0] == "shutdown":
                        return
                except (EOFError, OSError):
                    return

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait(self, timeout_s: float) -> bool:
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def kill(self) -> None:
        pass

    def log_tail(self, lines: int = 40) -> str:
        return ""


def test_a_gated_start_sends_the_config_only_once_the_gate_opens(tmp_path: Path) -> None:
    """A colocated run's ranks connect (and import megatron) while its engines start; they build on
    the devices only after the engines sleep. The wait for the gate is not the ranks' start timeout."""
    events: list[tuple[str, float]] = []
    gate = threading.Event()
    opened: list[float] = []

    def open_gate() -> None:
        opened.append(time.monotonic())
        gate.set()

    threading.Timer(1.5, open_gate).start()  # longer than start_timeout_s
    group = TrainerGroup("x: 1\n", 1, run_dir=tmp_path, start_timeout_s=1.0, gate=gate,
                         spawn=lambda args, env: ThreadRank(args, env, events))
    try:
        (what0, t_connect), (what1, t_config) = events
        assert (what0, what1) == ("connected", "config")
        assert t_connect < opened[0] <= t_config  # connected before, configured after the gate
    finally:
        group.close(timeout_s=5)


def test_an_ungated_start_sends_the_config_at_once(tmp_path: Path) -> None:
    events: list[tuple[str, float]] = []
    t0 = time.monotonic()
    group = TrainerGroup("x: 1\n", 1, run_dir=tmp_path, start_timeout_s=5,
                         spawn=lambda args, env: ThreadRank(args, env, events))
    group.close(timeout_s=5)
    assert [w for w, _ in events] == ["connected", "config"] and events[-1][1] - t0 < 1.0


def test_a_cancel_while_gated_kills_the_ranks(tmp_path: Path) -> None:
    """The ranks are connected and wait for the config at the gate, which never opens (the engines'
    start was cancelled): the start stops at once and no rank gets the config."""
    events: list[tuple[str, float]] = []
    cancel, gate = threading.Event(), threading.Event()
    threading.Timer(0.5, cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(TrainerError, match="cancelled"):
        TrainerGroup("x: 1\n", 1, run_dir=tmp_path, start_timeout_s=60, cancel=cancel, gate=gate,
                     spawn=lambda args, env: ThreadRank(args, env, events))
    assert time.monotonic() - t0 < 5
    assert [w for w, _ in events] == ["connected"]


def test_the_start_timeout_runs_from_the_gates_opening_even_when_no_rank_connects(tmp_path: Path) -> None:
    """A rank that died before connecting: the start still times out once the gate is open (the
    clock used to start only when every rank had connected, so it waited forever)."""
    made: list[NeverConnect] = []
    gate = threading.Event()
    threading.Timer(0.5, gate.set).start()
    t0 = time.monotonic()
    with pytest.raises(TrainerError, match="only 0/1 ranks connected within 1 s"):
        TrainerGroup("x: 1\n", 1, run_dir=tmp_path, start_timeout_s=1, spawn=_spawner(made), gate=gate)
    assert 1.4 < time.monotonic() - t0 < 5  # the gate's 0.5 s, then the 1 s timeout


class Exited(NeverConnect):
    def wait(self, timeout_s: float) -> bool:
        return True


def test_rank_processes_that_exited_fail_the_start_without_waiting_for_the_timeout(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(TrainerError, match="the rank processes exited with 0/2 ranks connected"):
        TrainerGroup("x: 1\n", 2, run_dir=tmp_path, start_timeout_s=60, spawn=lambda args, env: Exited())
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("code", [0, 3])
def test_local_torchrun_leaves_nothing_in_the_temp_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          code: int) -> None:
    """Real torchrun, with a rank script that exits `code`: torchrun makes a `torchelastic_*` folder
    in the temp dir per launch unless told --log-dir=/dev/null (thousands had piled up in /tmp);
    a failed rank is still reported in the group's log (its exit code and what it printed)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    script = tmp_path / "rank.py"
    script.write_text(f"import sys\nprint('rank says hello', flush=True)\nsys.exit({code})\n")
    proc = group_mod.LocalTorchrun(1, [str(script)], {}, tmp_path / "trainer.log")
    try:
        assert proc.wait(120)
    finally:
        proc.kill()
    log = (tmp_path / "trainer.log").read_text()
    assert "rank says hello" in log
    if code:
        assert "exitcode  : 3" in log, log[-3000:]
    assert list(tmp.iterdir()) == []

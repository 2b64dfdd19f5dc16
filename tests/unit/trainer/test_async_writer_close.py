"""checkpoint.async_save's background writer is stopped when a rank ends. megatron-core's
persistent writer is a non-daemon `spawn` child that waits on its queue until told 'DONE': a rank
that exits without closing the queue waits for it forever in multiprocessing's exit handler (an
H200 run of tests/gpu/trainer/test_async_checkpoint_gpu.py: the rank never exited). The trainer
service closes the queue at `shutdown` (finalizing what is pending, collectively); a rank that
leaves otherwise kills the writer from an exit handler that runs before multiprocessing's.
On CPU megatron-core's own writer cannot start (it sets a CUDA device), so the queue here is a
double whose writer is a real non-daemon spawn child blocked on a JoinableQueue, as megatron's."""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mlrl.trainer.rank import dist_ckpt

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


class Process:
    def __init__(self, alive=True):
        self.alive, self.killed = alive, False

    def is_alive(self):
        return self.alive

    def kill(self):
        self.killed = True


class Writer:
    def __init__(self, alive=True):
        self.process = Process(alive)


class Queue:
    """megatron-core's AsyncCallsQueue(persistent=True), as close_async_saves uses it."""

    def __init__(self, fail: bool = False, pending: int = 0, alive: bool = True, abort_fails: bool = False):
        self.calls: list[bool] = []
        self.fail, self.pending, self.abort_fails = fail, pending, abort_fails
        self.persistent_caller = Writer(alive)

    def close(self, abort: bool = False) -> None:
        self.calls.append(abort)
        if (self.fail and not abort) or (self.abort_fails and abort):
            raise RuntimeError("close failed")

    def get_num_unfinalized_calls(self) -> int:
        return self.pending


@pytest.fixture(autouse=True)
def _no_queue(monkeypatch):
    monkeypatch.setattr(dist_ckpt, "_ASYNC_QUEUE", None)


def test_with_nothing_pending_the_writer_is_told_to_stop_once():
    q = Queue()
    dist_ckpt._ASYNC_QUEUE = q
    dist_ckpt.close_async_saves()
    assert q.calls == [False] and dist_ckpt._ASYNC_QUEUE is None  # close(): 'DONE' + join, no collective
    dist_ckpt.close_async_saves()                                   # nothing left: no second close
    dist_ckpt._stop_async_writer_at_exit()
    assert q.calls == [False]


@pytest.mark.parametrize("queue", [Queue(pending=1), Queue(alive=False)], ids=["a save pending", "the writer died"])
def test_a_pending_save_or_a_dead_writer_is_aborted_without_a_collective(queue, caplog):
    """A save the driver gave up on is not finalized at shutdown (a collective a stuck rank would
    hang), and close() would wait forever on a dead writer's queue: both kill it."""
    dist_ckpt._ASYNC_QUEUE = queue
    with caplog.at_level(logging.WARNING, logger=dist_ckpt.__name__):
        dist_ckpt.close_async_saves()
    assert queue.calls == [True] and dist_ckpt._ASYNC_QUEUE is None
    assert "stopping the async checkpoint writer" in caplog.text


def test_a_failed_close_leaves_the_writer_to_the_exit_handler(caplog):
    q = Queue(fail=True)
    dist_ckpt._ASYNC_QUEUE = q
    with pytest.raises(RuntimeError):
        dist_ckpt.close_async_saves()
    assert dist_ckpt._ASYNC_QUEUE is q
    with caplog.at_level(logging.WARNING, logger=dist_ckpt.__name__):
        dist_ckpt._stop_async_writer_at_exit()
    assert q.calls == [False, True] and dist_ckpt._ASYNC_QUEUE is None  # abort: kill, no collective
    assert "0 save(s) left unfinalized" in caplog.text


def test_an_abort_that_raises_still_kills_the_writer():
    """megatron's close() reads the process group's rank before it kills: without a group it raises."""
    q = Queue(abort_fails=True, pending=2)
    dist_ckpt._ASYNC_QUEUE = q
    dist_ckpt._stop_async_writer_at_exit()
    assert q.calls == [True] and q.persistent_caller.process.killed


SCRIPT = textwrap.dedent("""
    import multiprocessing as mp
    import sys
    import types

    def writer(q):  # megatron's PersistentAsyncCaller.async_loop: serves until 'DONE'
        while True:
            item = q.get()
            q.task_done()
            if item == "DONE":
                break

    class Queue:  # AsyncCallsQueue(persistent=True) with a writer started, no save pending
        def __init__(self, persistent):
            ctx = mp.get_context("spawn")
            self.q = ctx.JoinableQueue()
            self.p = ctx.Process(target=writer, args=(self.q,))
            self.p.start()
            self.q.put("save")  # served: the writer is up and waiting, as after a first save
            self.q.join()
        def get_num_unfinalized_calls(self):
            return 0
        def close(self, abort=False):
            if abort:
                self.p.kill()
            else:
                self.q.put("DONE")
                self.p.join()

    if __name__ == "__main__":  # megatron's module, without megatron's import (seconds)
        au = types.ModuleType("megatron.core.dist_checkpointing.strategies.async_utils")
        au.AsyncCallsQueue = Queue
        sys.modules[au.__name__] = au
        from mlrl.trainer.rank import dist_ckpt
        q = dist_ckpt._async_queue()
        if sys.argv[1] == "close":
            dist_ckpt.close_async_saves()
        elif sys.argv[1] == "no-handler":
            import atexit
            atexit.unregister(dist_ckpt._stop_async_writer_at_exit)
        print("leaving", flush=True)
""")


@pytest.mark.parametrize("how", ["close", "exit-handler"])
def test_a_rank_with_a_writer_exits(tmp_path, how):
    (tmp_path / "rank.py").write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(tmp_path / "rank.py"), how], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "leaving" in out.stdout, out.stderr


def test_without_the_exit_handler_the_rank_hangs(tmp_path):
    """The control: the same rank with the handler unregistered never exits (what the H200 showed)."""
    (tmp_path / "rank.py").write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "rank.py"), "no-handler"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, text=True)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=4)
        assert proc.stdout is not None and "leaving" in proc.stdout.readline()  # it reached the end of main
    finally:
        proc.kill()
        proc.wait()

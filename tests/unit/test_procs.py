"""mlrl.procs.kill_tree stops a process and the descendants it started in sessions of their own (what
torchrun does with its workers), so a pipe they inherited closes and no process is left running."""

import os
import signal
import subprocess
import sys
import time

import psutil

from mlrl.procs import kill_tree

# a parent in its own group that starts a grandchild in a session of its own (like torchrun's
# workers), prints the grandchild's pid, and sleeps; the grandchild inherits stdout and sleeps too
_PARENT = """
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(g.pid, flush=True)
time.sleep(600)
"""


def _start():
    proc = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    grandchild = int(proc.stdout.readline())
    assert os.getpgid(grandchild) != os.getpgid(proc.pid)  # its own group: killpg(parent) misses it
    return proc, grandchild


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_kill_tree_reaches_a_grandchild_in_its_own_session():
    proc, grandchild = _start()
    try:
        kill_tree(proc.pid)
        out, _ = proc.communicate(timeout=10)  # hangs if the grandchild still holds the pipe
        assert proc.returncode == -signal.SIGKILL
        assert _gone(grandchild), f"grandchild {grandchild} survived"
    finally:
        for pid in (grandchild, proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_killpg_alone_leaves_the_grandchild_running():
    """The reason kill_tree exists: the group kill of the parent does not reach the grandchild."""
    proc, grandchild = _start()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert not _gone(grandchild, within_s=0.5)
    finally:
        kill_tree(grandchild)
        proc.stdout.close()
    assert _gone(grandchild)


def test_kill_tree_of_an_exited_process_is_a_no_op():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    assert _gone(proc.pid)  # a zombie until reaped: its pid cannot be reused by another process yet
    kill_tree(proc.pid)  # no error
    assert proc.wait(timeout=10) == 0  # it exited on its own, before any signal

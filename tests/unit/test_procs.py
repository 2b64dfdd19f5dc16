"""mlrl.procs.kill_tree stops a process and the descendants it started in sessions of their own (what
torchrun does with its workers), so a pipe they inherited closes and no process is left running;
mlrl.procs.exit_without_finalising ends the launcher as a normal exit would, minus finalisation."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from mlrl.procs import kill_tree

ROOT = Path(__file__).resolve().parents[2]

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


EXIT_SCRIPT = """
import atexit, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from mlrl.procs import exit_without_finalising

class Finalised:
    def __del__(self, write=os.write):  # runs only in the interpreter's finalisation
        write(1, b"finalised")

keep = Finalised()
log = sys.argv[1]
atexit.register(lambda: open(log, "a").write("handler ran;"))
def late():
    time.sleep(0.3)
    open(log, "a").write("thread done;")
threading.Thread(target=late).start()  # a non-daemon thread: a normal exit waits for it
idle = ThreadPoolExecutor(1)  # never shut down: its worker ends through the executors' exit hook
idle.submit(lambda: None).result()
print("buffered", end="")
exit_without_finalising(int(sys.argv[2]))
"""


def test_the_launchers_exit_joins_threads_runs_handlers_flushes_and_skips_finalising(tmp_path):
    """`python -m mlrl.launch` ends through exit_without_finalising: what a normal exit does first
    (threads joined, then the exit handlers, buffered output written, the code kept), without the
    interpreter's finalisation (1.5-1.7 s of torch / transformers teardown at an SFT run's end)."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    for code in (0, 3):
        log = tmp_path / f"log{code}"
        proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(log), str(code)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == code, proc.stderr[-2000:]
        assert log.read_text() == "thread done;handler ran;"  # the thread first, as at a normal exit
        assert proc.stdout == "buffered"
    # the same object is finalised on a plain exit: the check above can fail
    plain = EXIT_SCRIPT.replace("exit_without_finalising(int(sys.argv[2]))", "sys.exit(int(sys.argv[2]))")
    proc = subprocess.run([sys.executable, "-c", plain, str(tmp_path / "plain"), "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout == "bufferedfinalised"
    assert (tmp_path / "plain").read_text() == "thread done;handler ran;"

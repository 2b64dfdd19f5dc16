"""Local process helpers: starting ranks under torchrun (`torchrun_command`, `free_port`),
stopping a process together with everything it started (`kill_tree`), and ending this one without
the interpreter's finalisation (`exit_without_finalising`).

torchrun starts each worker in a session of its own (torch.distributed.elastic's subprocess handler
passes ``start_new_session=True``), so ``os.killpg`` on torchrun's group leaves its ranks running,
re-parented to init and still holding the pipes and ports torchrun was given. :func:`kill_tree` lists
the descendants first (psutil, already a dependency of megatron-core's dist_checkpointing), then
SIGKILLs the root's group and every descendant's group, so a timeout or Ctrl-C leaves nothing behind.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading
from typing import NoReturn

import psutil


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` (an IPv4 or IPv6 address) right now (the OS's pick)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, *args: str) -> list[str]:
    """`python -m torch.distributed.run` starting `nproc` ranks on this machine, then `args` (the
    script or `-m module` and its arguments). `--log-dir=/dev/null`: torchrun would otherwise make a
    `torchelastic_*` folder in the temp dir per launch for its per-rank error files and never remove
    it; the ranks' output goes to torchrun's own stdout / stderr either way."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}", f"--log-dir={os.devnull}", *args]


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid``'s process group and to the groups of all its descendants.

    Descendants are listed before any signal is sent: once the root dies its children are
    re-parented and can no longer be found from it. Processes already gone are skipped.
    """
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    groups = {pid}
    for p in procs:
        try:
            groups.add(os.getpgid(p.pid))
        except (ProcessLookupError, PermissionError):
            pass
    groups.discard(os.getpgrp())  # never our own group
    for g in groups:
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:  # a descendant that shares a group we may not signal
        try:
            p.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def exit_without_finalising(code: int, *, join_threads: bool = True) -> NoReturn:
    """End this process with `code` the way a normal exit does, minus the interpreter's
    finalisation: with `join_threads`, threading's own exit step (the executors' exit hooks, then
    every non-daemon thread joined), then the atexit handlers (logging's flush, multiprocessing's
    joins of its children, Ray's shutdown, the async checkpoint writer's), buffered output written,
    and `os._exit`. What it skips is the module teardown and native finalizers of torch,
    transformers, megatron-core and triton: ~1 s of a trainer rank's end, 1.5-1.7 s of the
    launcher's at the end of an SFT run and 0.4 s of a GRPO run's (tools/bench_rank_exit.py,
    tools/bench_run_end.py). A process that may leave a non-daemon thread running and must not wait
    for it (a trainer rank: its loop runs in the main thread) passes join_threads=False."""
    if join_threads:
        threading._shutdown()  # pyright: ignore[reportAttributeAccessIssue]  # CPython's first exit step
    atexit._run_exitfuncs()  # (and its next one)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be written
            pass
    os._exit(code)

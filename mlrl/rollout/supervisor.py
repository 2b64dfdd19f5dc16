"""Keeps one vLLM server's process tree tied to the mlrl process that launched it.

Why a separate supervisor: a vLLM OpenAI server is three process levels (API server ->
EngineCore -> Worker). Killing the API server alone leaves EngineCore and its workers running
(measured: they are re-parented to init and keep their memory), and PR_SET_PDEATHSIG does not
propagate to grandchildren (it is cleared on fork). So every server is started as

    python -m mlrl.rollout.supervisor --pgid-file F --parent-pid P -- <vllm command...>

which puts the vLLM tree into its own process group, writes that group id to F, and then:
- exits with the server's exit code when the server dies (after killing what is left of the group);
- on SIGTERM / SIGINT (clean shutdown) sends SIGTERM to the group, waits `--grace` seconds, then
  SIGKILLs it;
- when the launching process P disappears (its pid is no longer our parent: killed, crashed,
  exited without cleanup) it kills the group, so no engine outlives the job;
- if the supervisor itself is SIGKILLed (Ray kills the children of a dead actor that way: under
  `--nodes` the launcher is a node agent), the server gets SIGTERM through PR_SET_PDEATHSIG and
  shuts its EngineCore and workers down itself (measured: gone within seconds), and a watchdog
  (this module with `--watch PGID`, a child of the supervisor in its own session, out of reach of
  what killed the supervisor) SIGKILLs whatever of the group is left after `--grace` seconds.

The server's tree gets a temp folder of its own (`TMPDIR`, made here, removed once the group is
gone, by the supervisor or else by its watchdog): vLLM's single-machine executors rendezvous
through a gloo FileStore file `<temp>/vllm_dist_<uuid>` that nothing removes, one per engine start
(1,600 had piled up in /tmp on a CI machine). torch's inductor cache keeps its usual place (under
the temp folder the supervisor itself was given) unless `TORCHINDUCTOR_CACHE_DIR` says otherwise,
so compiled kernels are still shared between runs.

Standard library only: it must start fast and import neither torch nor vllm.
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SCRATCH_PREFIX = "mlrl-e"  # short: vLLM's ZMQ sockets are <temp>/<uuid4>, and a socket path has 107 bytes


def pids_in_group(pgid: int) -> list[int]:
    """The live (non-zombie) processes of a process group, read from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


def _group_alive(pgid: int) -> bool:
    """Whether a non-zombie process of the group exists (zombies count for kill(0) but are harmless)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return not os.path.isdir("/proc") or bool(pids_in_group(pgid))


def _kill_group(pgid: int, grace_s: float, child: subprocess.Popen | None) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if child is not None:
            child.poll()  # reap the leader so it does not count as alive
        if not _group_alive(pgid):
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _term_with_parent() -> None:
    """In the server process before exec: SIGTERM when the supervisor dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def server_env(scratch: str) -> dict[str, str]:
    """This process's environment for the server's tree: `TMPDIR` = its own temp folder, and torch
    inductor's cache where torch would put it without that (`default_cache_dir`: the temp folder
    + torchinductor_<user>), unless set."""
    env = dict(os.environ)
    if "TORCHINDUCTOR_CACHE_DIR" not in env:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = f"uid_{os.getuid()}"
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                      "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    env["TMPDIR"] = scratch
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--pgid-file", help="where to write the server's process-group id")
    p.add_argument("--watch", type=int, metavar="PGID", help="watchdog mode: stop group PGID when --parent-pid goes")
    p.add_argument("--parent-pid", type=int, required=True, help="pid of the launching mlrl process")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--scratch", help="watchdog mode: the server's temp folder, removed once the group is stopped")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- followed by the server command")
    args = p.parse_args(argv)
    if args.watch is not None:
        return _watch(args.watch, args.parent_pid, args.grace, args.scratch)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("missing server command after --")
    if not args.pgid_file:
        p.error("--pgid-file is required")

    stop = {"signal": 0}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)
    child = None
    try:
        child = subprocess.Popen(
            cmd, start_new_session=True, preexec_fn=_term_with_parent, env=server_env(scratch)
        )  # own group: killpg reaches EngineCore + workers
        pgid = child.pid
        tmp = f"{args.pgid_file}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{pgid}\n")
        os.replace(tmp, args.pgid_file)
        watchdog = subprocess.Popen([sys.executable, "-m", "mlrl.rollout.supervisor", "--watch", str(pgid),
                                     "--parent-pid", str(os.getpid()), "--grace", str(args.grace),
                                     "--scratch", scratch], start_new_session=True, stdin=subprocess.DEVNULL)
    except BaseException:  # no watchdog to clean up after us yet
        if child is not None:
            _kill_group(child.pid, args.grace, child)
        shutil.rmtree(scratch, ignore_errors=True)
        raise

    code = 0
    while True:
        rc = child.poll()
        if rc is not None:
            code = rc
            break
        if stop["signal"]:
            code = 128 + stop["signal"]
            break
        if os.getppid() != args.parent_pid:  # the launcher is gone (we were re-parented)
            code = 129
            break
        time.sleep(0.2)
    _kill_group(pgid, args.grace, child)
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    shutil.rmtree(scratch, ignore_errors=True)
    watchdog.terminate()  # the group is gone: nothing left to watch
    watchdog.wait()
    return code


def _watch(pgid: int, parent_pid: int, grace_s: float, scratch: str | None) -> int:
    """Watchdog: once the supervisor is gone (we were re-parented), stop what is left of the group
    and remove its temp folder."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    _kill_group(pgid, grace_s, None)  # returns at once if the supervisor already stopped the group
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

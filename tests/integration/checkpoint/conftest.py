"""Shared launches of the checkpoint tests (session-scoped: each torchrun job runs once).

The model is builtin:tiny-llama (with head_dim 32 if it had another: the vLLM CPU attention
backend supports only some head sizes, and the export test serves the trained model).
Launches, in dependency order:

    saved_tp2   TP2 (2 ranks): 4 steps straight; 2 steps + save (fully / dp_reshardable); also
                tiny qwen3_moe (TP2 + sequence parallel)
    saved_pp2   PP2 (2 ranks): the same
    resumed_tp2 TP2: new processes load the TP2 checkpoint, steps 3-4, HF export, probe logits
    killed      1 rank: save + commit step 1, then a save of step 2 SIGKILLed mid-way
    resumed_dp2 TP1 x DP2: load the TP2, PP2 and MoE checkpoints (reshard), bad inputs, the killed run
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "trainer"))
from trainer_harness import run_torchrun  # noqa: E402

from mlrl.procs import torchrun_command  # noqa: E402

WORKER = HERE / "ckpt_worker.py"


VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _variant(src: Path, out: Path, **changes) -> Path:
    """A copy of a model folder with config changes and a seeded random init."""
    import transformers

    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy2(f, out / f.name)
    cfg = {**json.loads((src / "config.json").read_text()), **changes}
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "transformers_version"})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """builtin:tiny-llama, with a head_dim the vLLM CPU attention backend supports (the export
    test serves the trained model)."""
    from mlrl.modelzoo import resolve_model_dir

    src = resolve_model_dir("builtin:tiny-llama")
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) in VLLM_CPU_HEAD_SIZES:
        return src
    return _variant(src, tmp_path_factory.mktemp("models") / "tiny-llama-vllm", head_dim=32)


@pytest.fixture(scope="session")
def wide_model(tiny_model, tmp_path_factory) -> Path:
    """The same architecture with another hidden size (an architecture mismatch)."""
    cfg = json.loads((tiny_model / "config.json").read_text())
    return _variant(
        tiny_model, tmp_path_factory.mktemp("models") / "tiny-llama-wide", hidden_size=2 * cfg["hidden_size"]
    )


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt-work")


def launch(nproc: int, work: Path, model: Path, phases: list[str], *, tp: int = 1, pp: int = 1, timeout: float = 420.0,
           other_model: Path | None = None):
    """Each rank's results of one worker launch, and the launch time in seconds."""
    t0 = time.perf_counter()
    args = ["--work", str(work), "--model", str(model), "--tp", str(tp), "--pp", str(pp), "--phases", ",".join(phases)]
    if other_model is not None:
        args += ["--other-model", str(other_model)]
    ranks, _ = run_torchrun(WORKER, args, nproc, timeout=timeout)
    return ranks, time.perf_counter() - t0


@pytest.fixture(scope="session")
def saved_tp2(work, tiny_model):
    return launch(2, work, tiny_model, ["train_save:tp2", "train_save:moe@tiny-qwen3-moe"], tp=2)


@pytest.fixture(scope="session")
def saved_pp2(work, tiny_model):
    return launch(2, work, tiny_model, ["train_save:pp2"], pp=2)


@pytest.fixture(scope="session")
def resumed_tp2(work, tiny_model, saved_tp2):
    return launch(2, work, tiny_model, ["resume:tp2"], tp=2)


def _alive(pid: int) -> bool:
    """Running (a zombie left to an init that does not reap counts as dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="session")
def killed(work, tiny_model, tmp_path_factory):
    """Starts a 1-rank job whose second save stalls after writing its shards, SIGKILLs the worker's
    and torchrun's process groups there, and returns what the dying save left behind."""
    out = tmp_path_factory.mktemp("kill")
    cmd = torchrun_command(
        1,
        str(WORKER),
        "--out",
        str(out),
        "--work",
        str(work),
        "--model",
        str(tiny_model),
        "--phases",
        "kill_save:kill",
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[2]), os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    marker = work / "kill_saving.0"
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            if proc.poll() is not None:
                raise AssertionError(f"the save-to-kill job exited early:\n{proc.stdout.read().decode()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError("the save-to-kill job never reached its second save")
            time.sleep(0.2)
        # torchrun starts its worker in a session of its own: kill the saving worker's group (the
        # worker and its helpers) first, then torchrun's
        worker = int((work / "kill_saving_pid.0").read_text())
        os.killpg(worker, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        for _ in range(100):
            if not _alive(worker):
                break
            time.sleep(0.1)
        assert not _alive(worker), f"the saving worker {worker} survived SIGKILL"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {"root": work / "kill_run", "tmp": Path(marker.read_text()), "returncode": proc.returncode}


@pytest.fixture(scope="session")
def resumed_dp2(work, tiny_model, wide_model, saved_tp2, saved_pp2, killed):
    return launch(
        2,
        work,
        tiny_model,
        ["resume:tp2", "resume:pp2", "resume:moe@tiny-qwen3-moe", "errors:tp2", "kill_resume:kill"],
        other_model=wide_model,
    )

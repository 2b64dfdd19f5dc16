"""SIGTERM (Slurm's scancel or time limit, `kill`) on a running `python -m mlrl.launch`: the run is
torn down in order instead of the driver dying at once. Before, the reward process pool's
forkserver and workers outlived the driver (re-parented to init), the metrics sinks were not
closed and the exit status was the bare signal.

Asserted on the real product (vLLM CPU server, megatron-core rank, reward pool): exit status 143
with a message naming the run directory, every process the run had started gone, and every
metrics line written complete.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.workers import another_workers

ROOT = Path(__file__).resolve().parents[3]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    return kids


def _descendants(pid: int) -> set[int]:
    kids, out, todo = _children(), set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_tears_the_whole_run_down(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "mlrl.launch", "--config", "launch/cpu_default.yaml",
           "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.total_steps=500",
           "logging.progress_bar=false", "rollout.startup_timeout_s=600", f"logging.run_dir={run_dir}",
           "checkpoint.save_at_end=false", "checkpoint.hf_export_at_end=false",
           # gsm8k scores a copied digit right too, and is a pool reward (exact_match is called
           # inline in the driver and starts no pool): the pool's processes must go as well
           "workflow.reward=gsm8k"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ))
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert p.poll() is None, f"the run ended early ({p.returncode}): {p.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no training step within 600 s"
            time.sleep(0.2)
        started = _descendants(p.pid)
        names = {Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                 for c in started if _alive(c)}
        # what must go: the engine, the trainer rank and the reward pool's processes
        assert any("vllm" in n.lower() for n in names) and any("mlrl.trainer.rank.service" in n for n in names)
        assert any("multiprocessing.forkserver" in n for n in names), names
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 143, f"exit status {p.returncode}:\n{err[-3000:]}"
    assert "terminated (SIGTERM)" in err and str(run_dir) in err
    deadline = time.monotonic() + 15  # (a process may still be exiting)
    while (left := [c for c in started if _alive(c)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [Path(f"/proc/{c}/cmdline").read_bytes()[:120] for c in left if _alive(c)]
    lines = metrics.read_text().splitlines()
    assert len(lines) >= 2 and all(json.loads(line)["step"] == i + 1 for i, line in enumerate(lines))


def test_sigterm_while_the_trainer_starts_stops_at_once(tmp_path):
    """SIGTERM during start-up, while the trainer ranks are still importing megatron and the
    engine is still loading: the run stops without waiting for either to come up, and none of
    their processes is left behind. Before, the trainer's start went on in its thread, whatever it
    built was closed by nobody, and the teardown first waited for the engines to be ready."""
    run_dir = tmp_path / "run"
    before = _trainer_processes()
    cmd = [sys.executable, "-m", "mlrl.launch", "--config", "launch/cpu_default.yaml", "trainer.total_steps=5",
           "logging.progress_bar=false", "rollout.startup_timeout_s=600", f"logging.run_dir={run_dir}"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ))
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "trainer_config.yaml").exists():  # written just before torchrun starts
            assert p.poll() is None, f"the run ended early ({p.returncode}): {p.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "the trainer did not start within 300 s"
            time.sleep(0.05)
        time.sleep(1.0)  # torchrun and its rank are up, importing
        started = _descendants(p.pid)
        names = {Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                 for c in started if _alive(c)}
        assert any("torch.distributed.run" in n for n in names), names
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=180)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 143, f"exit status {p.returncode}:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
    assert took < 20, f"{took:.1f} s from SIGTERM to exit"
    deadline = time.monotonic() + 15  # a rank torchrun started after the snapshot is orphaned, not a descendant
    while ((left := [c for c in started if _alive(c)] + sorted(_trainer_processes() - before))
           and time.monotonic() < deadline):
        time.sleep(0.2)
    assert not left, [Path(f"/proc/{c}/cmdline").read_bytes()[:120] for c in left if _alive(c)]


def _trainer_processes() -> set[int]:
    """Live torchrun agents and trainer ranks on this machine, whoever their parent is now (not
    those of a test running beside this one in another xdist worker)."""
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and _alive(int(d.name)) and not another_workers(int(d.name)):
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if b"torch.distributed.run" in cmd or b"mlrl.trainer.rank.service" in cmd:
                out.add(int(d.name))
    return out


def test_sigterm_in_a_colocated_rollout_writes_the_checkpoint_it_deferred(tmp_path):
    """Colocated, the checkpoint due at step k is made in step k+1's training phase (the engines
    asleep). A SIGTERM inside step k+1's rollout stopped the run before it: the checkpoint was lost
    (resume went back save_every more steps). The trainer still holds step k's weights and the engines
    are gone at teardown: it is written then."""
    run_dir, markers = tmp_path / "run", tmp_path / "markers"
    markers.mkdir()
    cmd = [sys.executable, "-m", "mlrl.launch", "--config", "launch/cpu_default.yaml", "cluster.placement=colocated",
           "workflow.name=tests.integration.loop.workflows.slow_rollout_workflow.SlowRolloutRLVR",
           "trainer.prompts_per_step=2", "trainer.samples_per_prompt=2", "trainer.total_steps=500",
           "checkpoint.save_every=1", "checkpoint.save_at_end=false", "checkpoint.hf_export_at_end=false",
           "logging.progress_bar=false", "rollout.startup_timeout_s=600", f"logging.run_dir={run_dir}"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, MLRL_TEST_MARKERS=str(markers)))
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert p.poll() is None, f"the run ended early ({p.returncode}): {p.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no two training steps within 600 s"
            time.sleep(0.1)
        seen = time.time()  # step 2's line is written: its checkpoint is deferred; wait for step 3's rollout
        while not any(float(m.name) > seen for m in markers.iterdir()):
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)  # the groups sleep SLOW_S seconds now: inside the rollout
        _, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 143, f"exit status {p.returncode}:\n{err[-3000:]}"
    steps = len(metrics.read_text().splitlines())
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{steps:06d}", (latest, steps, err[-3000:])
    state = json.loads((run_dir / "checkpoints" / latest / "trainer_state.json").read_text())
    assert state["step"] == steps and f"due at step {steps}" in err and "written at exit" in err

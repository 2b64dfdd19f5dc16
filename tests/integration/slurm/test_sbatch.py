"""`sbatch slurm/train_grpo.sh` on the real Slurm of conftest.py (two nodes on this host), with the
CPU recipe and the script's own #SBATCH defaults except the node count and `--gpus-per-node=0`:
- one node: the local CPU path, 2 steps, COMPLETED, metrics and the HF export written;
- two nodes: the Ray path (head + worker step, `mlrl.cluster wait`, `mlrl.launch --nodes 2`), the
  trainer rank on one Slurm node's Ray node and the engine on the other;
- cancelled mid-run, by a plain scancel (one node) and by `scancel --batch --signal=TERM` (two
  nodes): the launcher's orderly teardown (exit 143), Ray stopped, nothing half-written, and no
  process of the job left behind.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "slurm" / "train_grpo.sh"


def _submit(slurm, run_dir: Path, nodes: int, steps: int, wait: bool) -> tuple[str, Path]:
    out_file = run_dir.parent / f"{run_dir.name}-slurm.out"
    env = {**slurm.env, "MLRL_CONFIG": "launch/cpu_default.yaml", "MLRL_PYTHON": sys.executable,
           "MLRL_RAY_PORT": str(slurm.free_port()), "MLRL_RAY_WAIT_S": "120"}
    cmd = ["sbatch", "--parsable", f"--nodes={nodes}", "--gpus-per-node=0", f"--output={out_file}",
           str(SCRIPT), f"trainer.total_steps={steps}", f"logging.run_dir={run_dir}", "logging.progress_bar=false"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    job_id = out.stdout.strip().split(";")[0]
    assert out.returncode == 0 and job_id.isdigit(), out.stderr
    if wait:  # polled here: `sbatch --wait` sleeps 2, 8, then 32 s between its checks (a 15 s job took 42 s)
        info = slurm.wait_gone(job_id, timeout_s=900)
        assert info["ExitCode"] == "0:0", f"job {job_id}: {info['JobState']} {info['ExitCode']}\n" \
                                          f"{_tail(out_file)}\n{slurm.logs()}"
    return job_id, out_file


def _text(path: Path) -> str:
    """The job's output, without the reference-leak report triton's bindings print at exit."""
    if not path.exists():
        return f"({path} not written)"
    return "\n".join(ln for ln in path.read_text(errors="replace").splitlines() if "leaked" not in ln)


def _tail(path: Path, n: int = 60) -> str:
    return "\n".join(_text(path).splitlines()[-n:])


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _hf_export_written(run_dir: Path, step: int) -> None:
    export = run_dir / "hf" / f"step_{step:06d}"
    assert (export / "config.json").is_file() and list(export.glob("*.safetensors")), sorted(export.glob("*"))


def _job_processes(job_id: str) -> list[str]:
    """Processes whose environment says they belong to this Slurm job (Ray's raylet and workers,
    engines and trainer ranks all inherit SLURM_JOB_ID from their step)."""
    mine = f"SLURM_JOB_ID={job_id}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if mine in (d / "environ").read_bytes().split(b"\0"):
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{d.name}: {cmd[:150]}")
        except OSError:  # gone meanwhile, or a kernel thread
            continue
    return found


def _wait_no_processes(job_id: str, timeout_s: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := _job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(1)
    return left


def test_one_node_cpu_job_completes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    job_id, out_file = _submit(slurm, run_dir, nodes=1, steps=2, wait=True)
    info = slurm.job(job_id)
    text = _text(out_file)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "1 node without GPUs: mlrl's local CPU path (no Ray)" in text and "mlrl.launch exited 0" in text, text
    assert _steps(run_dir) == [1, 2]
    _hf_export_written(run_dir, 2)
    assert _wait_no_processes(job_id) == []


def test_two_node_cpu_job_runs_the_ray_path(slurm, tmp_path):
    run_dir = tmp_path / "run"
    # a process that `ray stop` would take for a Ray worker: the job must stop its own Ray only
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)", "default_worker.py"])
    try:
        job_id, out_file = _submit(slurm, run_dir, nodes=2, steps=2, wait=True)
        assert bystander.poll() is None, "the job's Ray shutdown ended a process outside the job"
    finally:
        bystander.kill()
        bystander.wait()
    info = slurm.job(job_id)
    text = _text(out_file)
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]"), text
    assert "2 node(s) x 1 CPU device slots" in text and "mlrl.cluster: 2 node(s)" in text, text
    assert "mlrl.launch exited 0" in text, text
    # Ray stopped without its SIGTERM drain, which timed out on the head (its GCS is signalled
    # with it) after 30 s before train_grpo.sh set RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0
    assert "Draining for up to" not in text and "Failed to mark the local node as draining" not in text, text
    place = json.loads((run_dir / "placement.json").read_text())
    nodes = {n["plan_node"]: n for n in place["nodes"]}
    assert len({n["node_id"] for n in nodes.values()}) == 2                      # two Ray nodes: n1's and n2's
    assert all(n["cuda"] is False for n in nodes.values())
    assert {w["plan_node"] for w in place["trainer"]} != {e["plan_node"] for e in place["engines"]}
    assert _steps(run_dir) == [1, 2]
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["weight_sync/canary_max_abs_diff"] <= 1e-3 and r["episodes/failures"] == 0 for r in recs), recs
    _hf_export_written(run_dir, 2)
    assert _wait_no_processes(job_id) == []          # the Ray steps were stopped with the job


def _cancel_after_first_step(slurm, run_dir: Path, nodes: int, *scancel: str) -> dict[str, str]:
    """Submit a long run, scancel it once a step is done, check the orderly end; the job's info."""
    job_id, out_file = _submit(slurm, run_dir, nodes=nodes, steps=500, wait=False)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        state = slurm.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"{state}\n{_tail(out_file)}"
        assert time.monotonic() < deadline, f"no step finished within 240 s\n{_tail(out_file)}"
        time.sleep(0.5)
    assert _job_processes(job_id)                     # the run is live: the checks below can fail
    slurm.run("scancel", *scancel, job_id)
    info = slurm.wait_gone(job_id, timeout_s=150)
    text = _text(out_file)
    assert "terminated (SIGTERM): engines, trainer ranks and reward workers stopped" in text, text
    assert "mlrl.launch exited 143 (after SIGTERM)" in text, text
    steps = _steps(run_dir)                           # every line whole: nothing half-written
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 500
    assert _wait_no_processes(job_id) == [], _tail(out_file)
    return info


def test_plain_scancel_tears_a_cpu_run_down_in_order(slurm, tmp_path):
    """`scancel JOB` signals every step and the batch shell at once; the launcher (no Ray on one
    node without GPUs) tears down in order and exits 143, and the batch shell waits for it."""
    info = _cancel_after_first_step(slurm, tmp_path / "run", 1)
    assert info["JobState"] == "CANCELLED"


def test_graceful_scancel_of_a_ray_run_stops_the_launcher_first(slurm, tmp_path):
    """`scancel --batch --signal=TERM JOB` (what the time limit does through --signal=B:TERM@180):
    the batch shell passes SIGTERM to the launcher step alone, which stops its engines and ranks
    through Ray while Ray is up; then the script stops Ray on both nodes and the job ends 143."""
    info = _cancel_after_first_step(slurm, tmp_path / "run", 2, "--batch", "--signal=TERM")
    assert info["ExitCode"] == "143:0", info
    text = _text(tmp_path / "run-slurm.out")
    assert "Draining for up to" not in text, text  # Ray stopped at once (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0)

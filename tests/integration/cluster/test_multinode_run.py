"""`python -m mlrl.launch --nodes 2` end to end on the Ray cluster simulated on this machine
(conftest.py: two worker nodes with 4 fake GPUs each; the runs use 2 or 1 per node). The launcher
is the Ray driver in its own process, as under Slurm; it reserves the
plan's GPUs, starts the Megatron ranks (DP2) on node A and two vLLM engines on node B through its
node agents, and runs the tiny recipe for 2 steps with weight sync over the network path.
The fake GPUs have no CUDA behind them, so every process takes its CPU path (gloo, vLLM CPU).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers.workers import another_workers

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[3]
ALL_GPUS = 8  # conftest.py: 2 nodes x 4 fake GPUs


def _command(cluster, run_dir: Path, *overrides: str, nodes: int = 2) -> list[str]:
    return [sys.executable, "-m", "mlrl.launch", "--nodes", str(nodes), "cluster.gpus_per_node=2",
            f"cluster.ray_address={cluster.address}", "rollout.num_engines=2", "trainer.prompts_per_step=4",
            "trainer.samples_per_prompt=4", "logging.progress_bar=false", f"logging.run_dir={run_dir}", *overrides]


def _launch(cluster, run_dir: Path, *overrides: str, nodes: int = 2, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(_command(cluster, run_dir, *overrides, nodes=nodes), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def _wait_all_gone(gpus: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (_mlrl_processes() or ray.available_resources().get("GPU", 0) < gpus) and time.monotonic() < deadline:
        time.sleep(0.5)


def _mlrl_processes() -> list[str]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if another_workers(p.pid):  # the test running beside this one (tests/helpers/workers.py)
            continue
        if any(
            k in cmd for k in ("mlrl.trainer.rank.service", "mlrl.rollout.supervisor", "vllm.entrypoints", "VLLM::")
        ):
            out.append(f"{p.pid}: {cmd[:120]}")
    return out


def test_two_node_run(cluster, tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    out = _launch(cluster, run_dir, "trainer.total_steps=2")
    assert out.returncode == 0, f"launch failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-8000:]}"
    print(f"2-node run: {time.monotonic() - t0:.0f} s")

    # start-up: the Ray placement has a mark of its own, after the input checks
    up = json.loads((run_dir / "startup.json").read_text())
    assert up["checks_s"] < up["placement_s"] < up["processes_s"], up

    # placement: trainer ranks on one GPU worker node, engines on the other
    place = json.loads((run_dir / "placement.json").read_text())
    gpu_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")}
    nodes = {n["plan_node"]: n for n in place["nodes"]}
    assert {n["node_id"] for n in nodes.values()} == gpu_nodes
    assert all(n["cuda"] is False for n in nodes.values())  # the nodes' own report: CPU paths taken
    assert [(w["rank"], w["plan_node"]) for w in place["trainer"]] == [(0, 0), (1, 0)]
    assert [w["env"]["WORLD_SIZE"] for w in place["trainer"]] == ["2", "2"]
    assert [(e["engine"], e["plan_node"]) for e in place["engines"]] == [(0, 1), (1, 1)]
    assert len({g for e in place["engines"] for g in e["gpu_ids"]}) == 2

    # one process per rank, started by node A's agent
    for r in (0, 1):
        assert (run_dir / "trainer" / f"rank-{r}.log").is_file()

    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["weight_sync/canary_max_abs_diff"] <= 1e-3, r   # weights crossed "nodes" intact
        assert r["train/mismatch/logprob_gap"] <= 1e-3, r
        assert r["weight_version"] == r["step"]
        assert r["episodes/total"] == 16 and r["episodes/failures"] == 0
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert (run_dir / "hf" / "step_000002" / "config.json").is_file()

    # teardown: every process gone, every reserved GPU given back
    _wait_all_gone(ALL_GPUS)
    assert _mlrl_processes() == []
    assert ray.available_resources().get("GPU", 0) == ALL_GPUS


def test_colocated_run_with_ranks_on_both_nodes(cluster, tmp_path):
    # one GPU per node, colocated: trainer rank r and engine r share node r's GPU, so the DP2
    # trainer's gloo group spans the two nodes and each node's engine gets its weights
    run_dir = tmp_path / "run"
    out = _launch(cluster, run_dir, "cluster.gpus_per_node=1", "cluster.placement=colocated", "trainer.total_steps=1",
                  "checkpoint.hf_export_at_end=false")
    assert out.returncode == 0, f"launch failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-8000:]}"
    place = json.loads((run_dir / "placement.json").read_text())
    assert [(w["rank"], w["plan_node"]) for w in place["trainer"]] == [(0, 0), (1, 1)]
    assert [(e["engine"], e["plan_node"]) for e in place["engines"]] == [(0, 0), (1, 1)]
    assert len({n["node_id"] for n in place["nodes"]}) == 2
    assert place["trainer"][1]["env"]["MASTER_ADDR"] == place["nodes"][0]["ip"]
    (rec,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rec["weight_sync/canary_max_abs_diff"] <= 1e-3 and rec["train/mismatch/logprob_gap"] <= 1e-3
    assert rec["episodes/total"] == 16 and rec["episodes/failures"] == 0
    _wait_all_gone(ALL_GPUS)
    assert _mlrl_processes() == []


def test_cluster_too_small_fails_clearly_and_starts_nothing(cluster, tmp_path):
    run_dir = tmp_path / "run"
    out = _launch(cluster, run_dir, "cluster.join_timeout_s=3", nodes=3, timeout=300)
    assert out.returncode == 4, out.stderr[-3000:]
    assert "cluster error: the Ray cluster has 2 node(s) with >= 2 GPUs after 3 s; cluster.nodes=3" in out.stderr
    assert not (run_dir / "placement.json").exists() and not (run_dir / "trainer").exists()
    assert ray.available_resources().get("GPU", 0) == ALL_GPUS



def test_killed_launcher_leaves_no_process_and_no_reservation(cluster, tmp_path):
    # SIGKILL: no cleanup code runs. Ray ends the driver's job (actors, placement groups); the
    # agents' children die with them (PR_SET_PDEATHSIG), and each vLLM server, its supervisor
    # SIGKILLed by Ray, gets SIGTERM and shuts down its EngineCore and workers.
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_command(cluster, run_dir, "trainer.total_steps=50"), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while not (run_dir / "metrics.jsonl").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None and (run_dir / "metrics.jsonl").exists(), "the run did not reach its first step"
        assert len([p for p in _mlrl_processes() if "mlrl.trainer.rank.service" in p]) == 2
        assert (
            len([p for p in _mlrl_processes() if "mlrl.rollout.supervisor --pgid-file" in p]) == 2
        )  # + a watchdog each
    finally:
        proc.kill()
        proc.wait()
    _wait_all_gone(ALL_GPUS)
    assert _mlrl_processes() == []
    assert ray.available_resources().get("GPU", 0) == ALL_GPUS

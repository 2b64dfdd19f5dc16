"""--nodes on the Ray cluster simulated on this machine (conftest.py). Checks node discovery,
STRICT_PACK placement groups pinned per node, the probe and the assignment."""

import time
from pathlib import Path

import pytest

from mlrl.cluster import ClusterError, join_cluster, release, wait_for_nodes
from mlrl.config import load_config, validate
from mlrl.plan import make_plan

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[3]


def plan_for(cluster, *overrides):
    cfg = load_config(ROOT / "launch" / "qwen3_8b_grpo.yaml",
                      [f"cluster.ray_address={cluster.address}", "cluster.gpu_memory_gb=1000",  # fake GPUs
                       "cluster.nodes=2", "cluster.gpus_per_node=4", *overrides])
    return cfg, make_plan(cfg, validate(cfg, dry_run=True))


def test_disaggregated_join(cluster):
    from ray.util.placement_group import placement_group_table

    cfg, plan = plan_for(cluster, "rollout.num_engines=2", "rollout.engine_tp=2")
    a = join_cluster(cfg, plan, wait_s=30, reserve_s=60)
    try:
        gpu_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")}
        assert {n.node_id for n in a.nodes} == gpu_nodes                       # two distinct GPU nodes
        table = [placement_group_table(pg) for pg in a.placement_groups]
        assert [t["strategy"] for t in table] == ["STRICT_PACK"] * 2 and all(t["state"] == "CREATED" for t in table)
        assert all(len(t["bundles"]) == 4 for t in table)
        assert [w.env["RANK"] for w in a.trainers] == ["0", "1", "2", "3"]
        assert {w.node_id for w in a.trainers} == {a.nodes[0].node_id}
        assert sorted(w.gpu_id for w in a.trainers) == [0, 1, 2, 3]
        assert a.trainers[0].env["CUDA_VISIBLE_DEVICES"] == ",".join(str(w.gpu_id) for w in a.trainers)
        assert {e.node_id for e in a.engines} == {a.nodes[1].node_id}
        assert sorted(g for e in a.engines for g in e.gpu_ids) == [0, 1, 2, 3]
        ports = [a.master_port, a.sync_port, *(e.port for e in a.engines)]
        assert all(1024 < p < 65536 for p in ports) and len(set(ports)) == len(ports)
    finally:
        release(a)
    assert a.placement_groups == []
    deadline = time.monotonic() + 20                                            # removal is asynchronous
    while ray.available_resources().get("GPU", 0) < 8 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU", 0) == 8                         # all GPUs given back


def test_colocated_join(cluster):
    cfg, plan = plan_for(cluster, "cluster.placement=colocated", "rollout.num_engines=4", "rollout.engine_tp=2",
                         "weight_sync.transport=disk")  # colocated on GPUs: see validate._check_colocate_transport
    a = join_cluster(cfg, plan, wait_s=30, reserve_s=60)
    try:
        assert len(a.trainers) == 8 and a.trainers[7].env["WORLD_SIZE"] == "8"
        for e in a.engines:
            sharing = [w for w in a.trainers if w.node_id == e.node_id and w.bundle in e.bundles]
            assert [w.gpu_id for w in sharing] == list(e.gpu_ids)
    finally:
        release(a)


def test_too_few_nodes_fails_clearly(cluster):
    with pytest.raises(ClusterError, match=r"has 2 node\(s\) with >= 4 GPUs after 1 s; cluster.nodes=3"):
        wait_for_nodes(3, 4, timeout_s=1, poll_s=0.5)
    with pytest.raises(ClusterError, match=r"has 0 node\(s\) with >= 8 GPUs"):
        wait_for_nodes(2, 8, timeout_s=0.5, poll_s=0.5)


def test_wait_cli(cluster, capsys):
    from mlrl.cluster.__main__ import main

    assert main(["wait", "--address", cluster.address, "--nodes", "2", "--gpus-per-node", "4", "--timeout", "5"]) == 0
    assert "2 node(s) with >= 4 GPUs" in capsys.readouterr().out
    assert main(["wait", "--address", cluster.address, "--nodes", "3", "--gpus-per-node", "4", "--timeout", "1"]) == 1
    assert "cluster.nodes=3 x cluster.gpus_per_node=4 are needed" in capsys.readouterr().err

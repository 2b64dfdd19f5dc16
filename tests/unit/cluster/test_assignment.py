"""Plan -> per-process placement and torch.distributed env, without Ray (fake probe results)."""

from pathlib import Path

import pytest

from mlrl.cluster import ClusterError, NodeInfo, assign, ports_needed
from mlrl.config import load_config, validate
from mlrl.plan import make_plan

ROOT = Path(__file__).resolve().parents[3]
QWEN8B = ROOT / "launch" / "qwen3_8b_grpo.yaml"


def plan_for(*overrides):
    cfg = load_config(QWEN8B, ["cluster.gpu_memory_gb=1000", *overrides])
    return make_plan(cfg, validate(cfg, dry_run=True))


def fake_nodes(plan, gpu_order=None):
    need = ports_needed(plan)
    g = plan.cfg.cluster.gpus_per_node
    return [NodeInfo(i, f"node{i}", f"10.0.0.{i + 1}", tuple(gpu_order or range(g)),
                     tuple(20000 + 100 * i + k for k in range(need[i]))) for i in range(plan.cfg.cluster.nodes)]


def test_disaggregated_two_nodes():
    plan = plan_for("cluster.nodes=2", "cluster.gpus_per_node=4", "rollout.num_engines=2", "rollout.engine_tp=2")
    assert ports_needed(plan) == {0: 2, 1: 2}
    a = assign(plan, fake_nodes(plan, gpu_order=[3, 2, 1, 0]))   # physical ids differ from bundle order
    assert [w.rank for w in a.trainers] == [0, 1, 2, 3]
    assert a.master_addr == "10.0.0.1" and (a.master_port, a.sync_port) == (20000, 20001)
    w = a.trainers[2]
    assert (w.node, w.bundle, w.gpu_id, w.local_rank) == (0, 2, 1, 2)
    assert w.env == {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "20000", "RANK": "2", "WORLD_SIZE": "4",
                     "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "3,2,1,0"}
    e0, e1 = a.engines
    assert (e0.node, e0.bundles, e0.gpu_ids, e0.env["CUDA_VISIBLE_DEVICES"]) == (1, (0, 1), (3, 2), "3,2")
    assert (e1.bundles, e1.gpu_ids) == ((2, 3), (1, 0))
    assert e0.url == "http://10.0.0.2:20100" and e1.port == 20101


def test_trainer_spanning_nodes_gets_local_ranks_per_node():
    plan = plan_for("cluster.nodes=2", "cluster.gpus_per_node=4", "rollout.num_engines=1", "rollout.engine_tp=2")
    a = assign(plan, fake_nodes(plan))
    assert [(w.rank, w.node, w.local_rank) for w in a.trainers] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 0, 2),
        (3, 0, 3),
        (4, 1, 0),
        (5, 1, 1),
    ]
    assert a.trainers[5].env["LOCAL_WORLD_SIZE"] == "2" and a.trainers[5].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert a.trainers[5].env["WORLD_SIZE"] == "6" and a.engines[0].bundles == (2, 3)


def test_colocated_engines_share_trainer_gpus():
    plan = plan_for("cluster.nodes=2", "cluster.gpus_per_node=4", "cluster.placement=colocated",
                    "rollout.num_engines=4", "rollout.engine_tp=2", "weight_sync.transport=disk")
    a = assign(plan, fake_nodes(plan))
    assert len(a.trainers) == 8 and len(a.engines) == 4
    for e in a.engines:
        ranks = [w for w in a.trainers if w.node == e.node and w.bundle in e.bundles]
        assert [w.gpu_id for w in ranks] == list(e.gpu_ids)


def test_probe_mismatch_is_an_error():
    plan = plan_for("cluster.nodes=2", "cluster.gpus_per_node=4", "rollout.num_engines=2", "rollout.engine_tp=2")
    nodes = fake_nodes(plan)
    with pytest.raises(ClusterError, match="got 1 probed node"):
        assign(plan, nodes[:1])
    bad = [nodes[0], NodeInfo(1, "n", "ip", (0, 1), nodes[1].ports)]
    with pytest.raises(ClusterError, match="reported 2 GPU bundle"):
        assign(plan, bad)

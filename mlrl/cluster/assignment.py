"""Plan + what the cluster reported -> who runs where, with the environment each process needs.

Pure (no Ray): `mlrl.cluster.ray_cluster` reserves the GPUs and probes each node (its IP, the
physical GPU id behind each placement-group bundle, free ports), then `assign` maps the plan onto
that. Plan node i is reserved as one placement group whose bundle g is plan GPU g of that node,
so the plan's (node, GPU) names a bundle, and the probe names the physical GPU behind it.

Trainer ranks get torchrun's environment: MASTER_ADDR/MASTER_PORT (rank 0's node), RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and CUDA_VISIBLE_DEVICES listing the node's trainer GPUs
in local-rank order (so `torch.cuda.set_device(LOCAL_RANK)` picks the planned GPU and NCCL sees
its node peers). Engines get CUDA_VISIBLE_DEVICES = their TP group's GPUs and an HTTP port on their
node. Processes started by Ray actors must set RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 (or
pass this env to a subprocess) so that Ray does not overwrite CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlrl.plan import Plan


class ClusterError(RuntimeError):
    """The cluster cannot host the plan (too few nodes/GPUs, reservation timed out, ...)."""


@dataclass(frozen=True)
class NodeInfo:
    """What the probe found on the node that hosts plan node `index`."""

    index: int
    node_id: str
    ip: str
    gpu_ids: tuple[int, ...]   # physical GPU id behind bundle g (= plan GPU g)
    ports: tuple[int, ...]     # free TCP ports on that node, as many as `ports_needed` asked for


@dataclass(frozen=True)
class TrainerWorker:
    rank: int
    local_rank: int
    node: int
    node_ip: str
    node_id: str
    gpu_id: int                # physical id
    bundle: int                # bundle index in the node's placement group
    env: dict[str, str]


@dataclass(frozen=True)
class EngineServer:
    engine: int
    node: int
    node_ip: str
    node_id: str
    gpu_ids: tuple[int, ...]   # physical ids, TP-rank order
    bundles: tuple[int, ...]
    port: int
    env: dict[str, str]

    @property
    def url(self) -> str:
        return f"http://{self.node_ip}:{self.port}"


@dataclass
class ClusterAssignment:
    trainers: list[TrainerWorker]
    engines: list[EngineServer]
    master_addr: str
    master_port: int           # torch.distributed rendezvous of the trainer
    sync_port: int             # weight-sync group (hosted by trainer rank 0)
    nodes: list[NodeInfo]
    placement_groups: list[Any] = field(default_factory=list)   # ray PlacementGroup per plan node


def _trainer_node(plan: Plan) -> int:
    return next(s.node for s in plan.slots if s.trainer is not None and s.trainer.rank == 0)


def ports_needed(plan: Plan) -> dict[int, int]:
    """Free ports to find per plan node: rendezvous + weight sync on rank 0's node, one per engine."""
    need = {s.node: 0 for s in plan.slots}
    need[_trainer_node(plan)] += 2
    for s in plan.slots:
        if s.engine is not None and s.engine.tp == 0:
            need[s.node] += 1
    return need


def assign(plan: Plan, nodes: list[NodeInfo]) -> ClusterAssignment:
    """Map the plan onto probed nodes (nodes[i] hosts plan node i)."""
    if plan.cpu:
        raise ClusterError(
            "the plan is a CPU run (cluster.gpus_per_node=0): there is nothing to place on a Ray cluster"
        )
    n_nodes = plan.cfg.cluster.nodes
    if len(nodes) != n_nodes:
        raise ClusterError(f"got {len(nodes)} probed node(s) for a plan of cluster.nodes={n_nodes}")
    for info in nodes:
        if len(info.gpu_ids) != plan.cfg.cluster.gpus_per_node:
            raise ClusterError(f"node {info.index} ({info.ip}) reported {len(info.gpu_ids)} GPU bundle(s), "
                               f"the plan expects cluster.gpus_per_node={plan.cfg.cluster.gpus_per_node}")
    free = {info.index: list(info.ports) for info in nodes}

    def take_port(node: int) -> int:
        if not free[node]:
            raise ClusterError(f"node {node} ({nodes[node].ip}): not enough free ports were probed")
        return free[node].pop(0)

    master_node = _trainer_node(plan)
    master_addr, master_port, sync_port = nodes[master_node].ip, take_port(master_node), take_port(master_node)
    world = plan.layout.trainer_devices

    by_node: dict[int, list] = {}
    for s in plan.slots:
        if s.trainer is not None:
            by_node.setdefault(s.node, []).append(s)
    trainers = []
    for node, slots in by_node.items():
        info = nodes[node]
        visible = ",".join(str(info.gpu_ids[s.gpu]) for s in slots)
        for local, s in enumerate(slots):
            env = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(s.trainer.rank),
                   "WORLD_SIZE": str(world), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(len(slots)),
                   "CUDA_VISIBLE_DEVICES": visible}
            trainers.append(
                TrainerWorker(s.trainer.rank, local, node, info.ip, info.node_id, info.gpu_ids[s.gpu], s.gpu, env)
            )
    trainers.sort(key=lambda w: w.rank)

    groups: dict[int, list] = {}
    for s in plan.slots:
        if s.engine is not None:
            groups.setdefault(s.engine.engine, []).append(s)
    engines = []
    for e, slots in sorted(groups.items()):
        slots.sort(key=lambda s: s.engine.tp)
        node = slots[0].node
        info = nodes[node]
        gpus = tuple(info.gpu_ids[s.gpu] for s in slots)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
        engines.append(
            EngineServer(e, node, info.ip, info.node_id, gpus, tuple(s.gpu for s in slots), take_port(node), env)
        )
    return ClusterAssignment(trainers, engines, master_addr, master_port, sync_port, list(nodes))

"""Running on a Ray cluster (`python -m mlrl.launch --nodes N`): reserve the GPUs the dry-run plan
names, map every trainer rank and engine onto them, and start them there (`runtime.ClusterRuntime`:
one node agent per node).

`join_cluster(cfg, plan) -> ClusterAssignment`, `release(assignment)`, `wait_for_nodes(...)`;
`python -m mlrl.cluster wait --address A --nodes N --gpus-per-node G` is what slurm/train_grpo.sh
runs to wait for its Ray workers. The mapping itself (`assign`) is pure and has no Ray import.
"""

from mlrl.cluster.assignment import (
    ClusterAssignment,
    ClusterError,
    EngineServer,
    NodeInfo,
    TrainerWorker,
    assign,
    ports_needed,
)
from mlrl.cluster.ray_cluster import join_cluster, release, wait_for_nodes

__all__ = [
    "ClusterAssignment", "ClusterError", "EngineServer", "NodeInfo", "TrainerWorker", "assign", "join_cluster",
    "ports_needed", "release", "wait_for_nodes",
]

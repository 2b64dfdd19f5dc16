"""Where a run's processes go: this machine (`local_placement`), or the nodes of a Ray cluster
(`cluster_placement`, `--nodes N`). Shared by the RL job (trainer ranks + engines), the
evaluation (engines alone) and the trainer-only jobs (SFT, DPO, RM: `Placement()`, this machine)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from mlrl.config import Config, ConfigError, Layout
from mlrl.trainer.driver.group import SpawnRanks

if TYPE_CHECKING:  # the trainer-only jobs place no engines: the rollout package is not imported for them
    from mlrl.rollout.server import ServerSpec

log = logging.getLogger("mlrl")


@dataclass
class Placement:
    """Where the processes of a run go: this machine, or the nodes of a Ray cluster."""

    host: str = "127.0.0.1"                              # address trainer ranks and engine workers reach the driver at
    trainer_env: dict[str, str] = field(default_factory=dict)
    engine_devices: list[list[int]] | None = None       # local GPU runs: CUDA devices per engine
    spawn_trainer: SpawnRanks | None = None              # None: torchrun on this machine
    engine_server: Callable[[int, ServerSpec], Any] | None = None
    sync_backend: str | None = None                      # None: NCCL if this machine has CUDA, else gloo
    close: Callable[[], None] = lambda: None


def local_placement(cfg: Config, layout: Layout) -> Placement:
    """One machine. With GPUs, the plan's split applies: trainer ranks and engines get their own
    devices (colocated: the same ones), mapped through the caller's CUDA_VISIBLE_DEVICES."""
    if cfg.cluster.gpus_per_node == 0:
        return Placement()
    ids = _local_gpus(cfg)
    if cfg.evaluate is not None:  # the engines alone: the policy's, then the judge's, engine_tp GPUs each
        tps = [cfg.rollout.engine_tp] * cfg.rollout.num_engines
        if cfg.reward_model is not None:
            tps += [cfg.reward_model.engine_tp] * cfg.reward_model.num_engines
        starts = [sum(tps[:i]) for i in range(len(tps))]
        return Placement(engine_devices=[list(ids[a:a + tp]) for a, tp in zip(starts, tps)])
    from mlrl.cluster import NodeInfo, assign, ports_needed
    from mlrl.plan import make_plan

    plan = make_plan(cfg, layout)
    ports = (0,) * ports_needed(plan)[0]  # torchrun and the engines pick their own ports on one machine
    a = assign(plan, [NodeInfo(0, "local", "127.0.0.1", ids, ports)])
    return Placement(trainer_env={"CUDA_VISIBLE_DEVICES": a.trainers[0].env["CUDA_VISIBLE_DEVICES"]},
                     engine_devices=[list(e.gpu_ids) for e in a.engines])


def _local_gpus(cfg: Config) -> tuple[int, ...]:
    """The indices of this machine's cluster.gpus_per_node GPUs, through the caller's CUDA_VISIBLE_DEVICES."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible and len(visible) < cfg.cluster.gpus_per_node:
        raise ConfigError(
            f"cluster.gpus_per_node={cfg.cluster.gpus_per_node} but CUDA_VISIBLE_DEVICES={','.join(visible)} "
            f"lists {len(visible)}"
        )
    if any(not d.isdigit() for d in visible[:cfg.cluster.gpus_per_node]):
        raise ConfigError(f"CUDA_VISIBLE_DEVICES={','.join(visible)}: mlrl places trainer ranks and engines by GPU "
                          "index; list the GPUs by index (nvidia-smi -L shows each UUID's index)")
    return tuple(int(visible[g]) if visible else g for g in range(cfg.cluster.gpus_per_node))


def cluster_placement(cfg: Config, layout: Layout, run_dir: Path) -> Placement:
    """`--nodes N`: join the Ray cluster, reserve the plan's GPUs, start one agent per node."""
    from mlrl.cluster import join_cluster, release
    from mlrl.cluster.runtime import ClusterRuntime
    from mlrl.plan import make_plan

    plan = make_plan(cfg, layout)
    assignment = join_cluster(cfg, plan, wait_s=cfg.cluster.join_timeout_s, reserve_s=cfg.cluster.join_timeout_s)
    try:
        rt = ClusterRuntime(assignment, run_dir)
    except BaseException:
        release(assignment)
        raise
    log.info("placed on %d Ray node(s): trainer ranks on %s, engines on %s", len(assignment.nodes),
             sorted({w.node_ip for w in assignment.trainers}), sorted({e.node_ip for e in assignment.engines}))

    def close() -> None:
        try:
            rt.close()
        finally:
            release(assignment)

    return Placement(host=rt.driver_ip, spawn_trainer=rt.spawn_trainer, engine_server=rt.engine_server,
                     sync_backend="nccl" if rt.cuda else "gloo", close=close)

"""Which GPU does what: trainer ranks with their parallel coordinates, and vLLM engine ranks.

Rank -> coordinates follows Megatron-Core's RankGenerator with its default order
"tp-cp-ep-dp-pp" (parallel_state.initialize_model_parallel): for the dense part
    rank = tp + TP * (cp + CP * (dp + DP * pp))
and for the expert part (expert TP `etp`, expert parallel `ep`, expert data parallel `edp`)
    rank = etp + ETP * (ep + EP * (edp + EDP * pp)),  EDP = world / (ETP * EP * PP).
A unit test checks these against megatron's own RankGenerator.

GPUs are numbered node-major (global index = node * gpus_per_node + local GPU). Trainer rank r
sits on global GPU r, so TP groups (consecutive ranks) stay inside a node when TP divides the GPUs
per node. Disaggregated: engines take the GPUs after the trainer's, each engine's TP group inside
one node (an engine never spans nodes: vLLM's TP runs over NVLink in one node here). Colocated:
engine e's TP ranks time-share GPUs e*engine_tp ... with the trainer ranks there.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlrl.config.validate import Layout


@dataclass(frozen=True)
class TrainerRank:
    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    etp: int   # expert tensor-parallel rank
    ep: int    # expert-parallel rank
    edp: int   # expert data-parallel rank

    def describe(self, moe: bool = True) -> str:
        dense = f"trainer rank {self.rank:>4}  tp{self.tp} cp{self.cp} dp{self.dp} pp{self.pp}"
        return f"{dense} | ep{self.ep} etp{self.etp} edp{self.edp}" if moe else dense


@dataclass(frozen=True)
class EngineRank:
    engine: int
    tp: int    # rank inside the engine's tensor-parallel group

    def describe(self) -> str:
        return f"engine {self.engine:>3} tp-rank {self.tp}"


@dataclass(frozen=True)
class GpuSlot:
    node: int
    gpu: int
    trainer: TrainerRank | None
    engine: EngineRank | None


def trainer_rank(rank: int, layout: Layout) -> TrainerRank:
    """Megatron's coordinates of a global trainer rank (order tp-cp-ep-dp-pp)."""
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    r = rank
    tp_r, r = r % tp, r // tp
    cp_r, r = r % cp, r // cp
    dp_r, pp_r = r % dp, r // dp
    etp, ep = layout.etp, layout.ep
    edp = layout.trainer_devices // (etp * ep * layout.pp)
    r = rank
    etp_r, r = r % etp, r // etp
    ep_r, r = r % ep, r // ep
    edp_r = r % edp
    return TrainerRank(rank, tp_r, cp_r, dp_r, pp_r, etp_r, ep_r, edp_r)


def expert_dp(layout: Layout) -> int:
    return layout.trainer_devices // (layout.etp * layout.ep * layout.pp)


def place(layout: Layout, nodes: int, gpus_per_node: int, num_engines: int, engine_tp: int,
          colocated: bool) -> tuple[list[GpuSlot], list[str]]:
    """Slots for every GPU of the cluster, and the reasons the placement is impossible (if any)."""
    total = nodes * gpus_per_node
    trainer: dict[int, TrainerRank] = {g: trainer_rank(g, layout) for g in range(layout.trainer_devices)}
    engine: dict[int, EngineRank] = {}
    problems: list[str] = []
    if engine_tp > gpus_per_node:
        problems.append(
            f"rollout.engine_tp={engine_tp} exceeds cluster.gpus_per_node={gpus_per_node} (an engine must fit in one "
            "node)"
        )
    else:
        start = 0 if colocated else layout.trainer_devices
        placed = 0
        g = start
        while placed < num_engines and g + engine_tp <= total:
            node_end = (g // gpus_per_node + 1) * gpus_per_node
            if g + engine_tp > node_end:  # would span two nodes: skip to the next node
                if colocated:
                    problems.append(
                        f"engine {placed} (rollout.engine_tp={engine_tp}) would span nodes {g // gpus_per_node} and "
                        f"{g // gpus_per_node + 1}: engine_tp must divide cluster.gpus_per_node={gpus_per_node} when "
                        "colocated"
                    )
                    break
                g = node_end
                continue
            for t in range(engine_tp):
                engine[g + t] = EngineRank(placed, t)
            placed += 1
            g += engine_tp
        if placed < num_engines and not problems:
            problems.append(
                f"only {placed} of rollout.num_engines={num_engines} engines (engine_tp={engine_tp}) fit on the GPUs "
                "left "
                f"without spanning nodes ({total - start} GPUs from global GPU {start})"
            )
    slots = [GpuSlot(g // gpus_per_node, g % gpus_per_node, trainer.get(g), engine.get(g)) for g in range(total)]
    return slots, problems


def tp_groups_spanning_nodes(layout: Layout, gpus_per_node: int) -> list[str]:
    """Warnings for trainer TP groups that cross a node boundary (TP traffic would leave NVLink)."""
    out = []
    for first in range(0, layout.trainer_devices, layout.tp):
        last = first + layout.tp - 1
        if first // gpus_per_node != last // gpus_per_node:
            out.append(
                f"trainer TP group of ranks {first}-{last} spans nodes {first // gpus_per_node}-{last // gpus_per_node}"
            )
    return out

"""Dry-run planning: which GPU does what and whether it fits, for any cluster, from anywhere.

`make_plan(cfg, layout) -> Plan` and `format_plan(plan) -> str` (what `--dry-run` prints).
The model, placement, memory and rendering parts live in their own modules; only config
dataclasses and the HF config dict are read, never weights, GPUs or a cluster.
"""

from mlrl.plan.placement import EngineRank, GpuSlot, TrainerRank, trainer_rank
from mlrl.plan.planner import Plan, make_plan
from mlrl.plan.render import format_plan

__all__ = ["EngineRank", "GpuSlot", "Plan", "TrainerRank", "format_plan", "make_plan", "trainer_rank"]

"""Megatron-Core parallel state for one trainer rank, and where this rank sits in it.

`init_parallel` is called once per process, after torchrun (or Ray) has set the usual env
(RANK, WORLD_SIZE, MASTER_ADDR, ...). It applies the CPU compat layer when CUDA is absent,
joins torch.distributed (gloo on CPU, NCCL on GPU) unless already joined, checks that the
world matches the resolved layout, creates Megatron's TP/PP/VPP/CP/EP/ETP/DP groups and seeds
every RNG (Megatron's tracker included). Calling it again with the same layout is a no-op, so a
policy and its frozen reference share one parallel state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, cast

import torch
import torch.distributed as dist

from mlrl.config.schema import ParallelConfig
from mlrl.config.validate import Layout
from mlrl.trainer.rank import cpu_compat

_STATE: Optional[tuple] = None


@dataclass(frozen=True)
class Ranks:
    """This rank's coordinates in every Megatron group."""

    rank: int
    world: int
    tp: int
    tp_size: int
    pp: int
    pp_size: int
    dp: int                 # data-parallel rank (the ranks of one dp rank share its micro-batches)
    dp_size: int
    cp: int
    cp_size: int
    ep: int
    ep_size: int
    etp: int
    etp_size: int
    edp: int                # expert-data-parallel rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp == self.pp_size - 1

    @property
    def is_stage_sender(self) -> bool:
        """The one rank per pipeline stage that yields exported HF tensors (tp 0, dp 0, cp 0)."""
        return self.tp == 0 and self.dp == 0 and self.cp == 0

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_parallel(parallel: ParallelConfig, layout: Layout, seed: int) -> Ranks:
    """Create (once) Megatron's process groups for `layout` and seed the RNGs; returns this rank."""
    global _STATE
    cpu_compat.apply()
    from megatron.core import parallel_state, tensor_parallel

    vpp = layout.vpp if layout.vpp and layout.vpp > 1 else None
    key = (layout.tp, layout.pp, vpp, layout.cp, layout.ep, layout.etp, seed)
    if _STATE is not None:
        if _STATE != key:
            raise RuntimeError(
                f"init_parallel: already initialised with (tp, pp, vpp, cp, ep, etp, seed)={_STATE}, asked for {key}"
            )
        return ranks()
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(minutes=30))
    world = dist.get_world_size()
    if world != layout.trainer_devices:
        raise RuntimeError(
            f"init_parallel: torch.distributed world size is {world}, the layout needs "
            f"tp*pp*cp*dp = {layout.tp}*{layout.pp}*{layout.cp}*{layout.dp} = {layout.trainer_devices} ranks"
        )
    if layout.cp > 1 and cpu_compat.needed():
        raise RuntimeError(f"parallel.cp={layout.cp}: context parallel needs CUDA (Transformer Engine attention)")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    _STATE = key
    return ranks()


def ranks() -> Ranks:
    from megatron.core import parallel_state as ps

    return Ranks(
        rank=dist.get_rank(), world=dist.get_world_size(),
        tp=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        cp=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size(),
        ep=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
        # megatron falls back to its TP values, None only before initialize_model_parallel
        etp=cast(int, ps.get_expert_tensor_parallel_rank()),
        etp_size=cast(int, ps.get_expert_tensor_parallel_world_size()),
        edp=ps.get_expert_data_parallel_rank(),
    )


def destroy_parallel() -> None:
    """Tear down Megatron's groups (tests that re-initialise in one process)."""
    global _STATE
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    _STATE = None

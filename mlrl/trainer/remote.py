"""The loop's view of the trainer: `RemotePolicy` (logprobs / train_step / save / load / export).

It hides that the policy is N Megatron ranks: micro-batches arrive per DP rank (the packer's
output) and are sent to every rank of that DP rank's model-parallel group; results come back
once per DP rank. Every call goes to all ranks (collectives), see `TrainerGroup`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mlrl.experience.batch import MicroBatch
from mlrl.trainer.group import TrainerGroup


class RemotePolicy:
    def __init__(self, group: TrainerGroup):
        self.group = group
        self.dp_rank_of = [int(info.get("dp_rank", 0)) for info in group.rank_info]
        self.dp_size = max(self.dp_rank_of) + 1

    def _per_rank(self, per_dp: list[list[MicroBatch]]) -> list[dict[str, Any]]:
        if len(per_dp) != self.dp_size:
            raise ValueError(f"got micro-batches for {len(per_dp)} DP ranks, the trainer has dp={self.dp_size}")
        return [{"micro_batches": per_dp[d]} for d in self.dp_rank_of]

    def _first_per_dp(self, results: list[Any]) -> list[Any]:
        out: list[Any] = [None] * self.dp_size
        for r, d in enumerate(self.dp_rank_of):
            if out[d] is None:
                out[d] = results[r]
        return out

    def compute_logprobs(self, per_dp: list[list[MicroBatch]], temperature: float, *,
                         reference: bool = False) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """[dp][micro-batch] -> (logprobs [S], entropy [S])."""
        res = self.group.call("compute_logprobs", self._per_rank(per_dp), temperature=temperature, reference=reference)
        return self._first_per_dp(res)

    def train_step(self, per_dp: list[list[MicroBatch]]) -> dict[str, float]:
        return self.group.call("train_step", self._per_rank(per_dp))[0]

    def save_checkpoint(self, path: Path) -> None:
        self.group.call("save_checkpoint", path=str(path))

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        return self.group.call("load_checkpoint", path=str(path))[0]

    def export_hf(self, out_dir: Path) -> None:
        self.group.call("export_hf", out_dir=str(out_dir))

    def call(self, method: str, **kwargs: Any) -> list[Any]:
        """Escape hatch for transport-specific collectives (weight sync)."""
        return self.group.call(method, **kwargs)

    def close(self) -> None:
        self.group.close()

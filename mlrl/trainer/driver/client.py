"""The driver's typed clients of the trainer ranks: `TrainerClient` (the loop's `Policy`),
`CriticClient` (its `Critic`) and `MegatronWeightSource` (the weight sync's `WeightSource`).

Each method mirrors one method of the rank-side `mlrl.trainer.rank.service.TrainerService` and
calls it by reference (`group.call_sharded(TrainerService.update, ...)`): a renamed or removed
service method fails at import time, and an argument of the wrong name or type fails the type
check of `make lint` (`TrainerGroup.call`'s ParamSpec is the service method's own parameters).

It hides that the trainer is N Megatron ranks: micro-batches arrive per DP rank (the packer's
output) and are sent to every rank of that DP rank's model-parallel group; results come back
once per DP rank. Every call goes to all ranks (collectives), see `TrainerGroup`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mlrl.experience.batch import MicroBatch
from mlrl.experience.packing import pack_step, unpack_per_sample
from mlrl.interfaces import PerDP, ResumeInfo, RouterDiagnostics
from mlrl.trainer.driver.group import TrainerGroup
from mlrl.trainer.rank.service import TrainerService
from mlrl.types import Sample
from mlrl.weight_sync.source import PushRequest, SendReport


class TrainerClient:
    """`mlrl.interfaces.Policy` over the trainer ranks."""

    def __init__(self, group: TrainerGroup):
        self.group = group
        self.dp_rank_of = [int(info.get("dp_rank", 0)) for info in group.rank_info]
        self.dp_size = max(self.dp_rank_of) + 1
        self.pp_size = max(int(info.get("pp", 0)) for info in group.rank_info) + 1

    def per_rank(self, per_dp: PerDP) -> list[list[MicroBatch]]:
        """Each rank's micro-batches: those of its DP rank."""
        if len(per_dp) != self.dp_size:
            raise ValueError(f"got micro-batches for {len(per_dp)} DP ranks, the trainer has dp={self.dp_size}")
        return [per_dp[d] for d in self.dp_rank_of]

    def first_per_dp(self, results: list[Any]) -> list[Any]:
        """One result per DP rank (every rank of a model-parallel group returns the same one)."""
        out: list[Any] = [None] * self.dp_size
        for r, d in enumerate(self.dp_rank_of):
            if out[d] is None:
                out[d] = results[r]
        return out

    def compute_logprobs(self, per_dp: PerDP, temperature: float, *,
                         reference: bool = False) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """[dp][micro-batch] -> (logprobs [S], entropy [S])."""
        res = self.group.call_sharded(TrainerService.compute_logprobs, self.per_rank(per_dp), temperature=temperature,
                              reference=reference)
        return self.first_per_dp(res)

    def router_diagnostics(self, per_dp: PerDP, temperature: float) -> RouterDiagnostics:
        """MoE router replay: logprobs with and without the engines' routes ([dp][mb] [S]), and
        the token-layer top-k sets equal to the engine's, over all ranks."""
        res = self.group.call_sharded(TrainerService.router_diagnostics, self.per_rank(per_dp), temperature=temperature)
        first = self.first_per_dp(res)
        return RouterDiagnostics(replay=[r.replay for r in first], own=[r.own for r in first],
                                 matches=res[0].matches, compared=res[0].compared)

    def update(self, per_dp: PerDP) -> dict[str, float]:
        return self.group.call_sharded(TrainerService.update, self.per_rank(per_dp))[0]

    def compute_scores(self, per_dp: PerDP) -> list[list[torch.Tensor]]:
        """A reward-model run: [dp][micro-batch] -> per-position scores [S] (mlrl.algorithms.rm_loss)."""
        return self.first_per_dp(self.group.call_sharded(TrainerService.compute_scores, self.per_rank(per_dp)))

    def save_checkpoint(self, path: Path, critic_path: Path | None = None) -> None:
        """The policy's training state into `path`, and the critic's into `critic_path` (if any)."""
        self.group.call(TrainerService.save_checkpoint, path=str(path),
                        critic_path=str(critic_path) if critic_path else None)

    def load_checkpoint(self, path: Path, critic_path: Path | None = None) -> ResumeInfo:
        return self.group.call(TrainerService.load_checkpoint, path=str(path),
                               critic_path=str(critic_path) if critic_path else None)[0]

    def finalize_checkpoints(self, blocking: bool = True) -> int:
        """Finalize finished async saves on every rank; returns how many are still pending (0 = all done)."""
        return self.group.call(TrainerService.finalize_checkpoints, blocking=blocking)[0]

    def export_hf(self, out_dir: Path) -> None:
        self.group.call(TrainerService.export_hf, out_dir=str(out_dir))

    def offload(self, kinds: list[str]) -> dict[str, float]:
        """Colocated placement: release the trainer's device memory of `kinds` ("params", "grads",
        "optimizer"). Returns bytes released per kind, bytes copied and the bytes the ranks' CUDA
        allocators measured as freed ("measured", 0 on CPU), summed over ranks; seconds (slowest rank)."""
        return _offload_totals(self.group.call(TrainerService.offload, kinds=list(kinds)))

    def reload(self, kinds: list[str] | None = None) -> dict[str, float]:
        """What `offload` released (`kinds`: only those), back on the device (bytes unchanged;
        gradients zeroed)."""
        return _offload_totals(self.group.call(TrainerService.reload, kinds))

    def close(self) -> None:
        self.group.close()


def _offload_totals(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {"copied": 0.0, "measured": 0.0, "seconds": 0.0}
    for r in per_rank:
        for kind, n in r["bytes"].items():
            out[kind] = out.get(kind, 0.0) + n
        out["copied"] += r["copied"]
        out["measured"] += r["measured"]
        out["seconds"] = max(out["seconds"], r["seconds"])
    return out


class CriticClient:
    """`mlrl.interfaces.Critic`: the value model living on the same trainer ranks as the policy."""

    def __init__(self, trainer: TrainerClient):
        self.trainer = trainer
        self.dp_size = trainer.dp_size

    def compute_values(self, per_dp: PerDP) -> list[list[torch.Tensor]]:
        """[dp][micro-batch] -> values [S] (token-aligned like logprobs)."""
        t = self.trainer
        return t.first_per_dp(t.group.call_sharded(TrainerService.compute_values, t.per_rank(per_dp)))

    def update(self, per_dp: PerDP) -> dict[str, float]:
        """One critic optimizer update on the micro-batches (old_values / returns attached)."""
        t = self.trainer
        return t.group.call_sharded(TrainerService.update_critic, t.per_rank(per_dp))[0]


class MegatronWeightSource:
    """`mlrl.weight_sync.WeightSource` over the remote Megatron ranks: one sender per pipeline stage."""

    def __init__(self, trainer: TrainerClient):
        self.trainer = trainer

    @property
    def num_senders(self) -> int:
        return self.trainer.pp_size

    def push(self, request: PushRequest) -> list[SendReport]:
        results = self.trainer.group.call(TrainerService.push_weights, request=request.to_json())
        reports = [SendReport.from_json(r) for r in results if r is not None]
        return sorted(reports, key=lambda r: r.sender)

    def canary_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        ids = list(prompt_ids) + list(completion_ids)
        n = len(ids)
        sample = Sample(tokens=ids, loss_mask=[0] * len(prompt_ids) + [1] * len(completion_ids),
                        rollout_logprobs=[0.0] * n, versions=[-1] * n, prompt_len=len(prompt_ids))
        per_dp, _ = pack_step([sample], dp_size=self.trainer.dp_size, token_budget=max(n, 1), loss_agg="token-mean")
        out = self.trainer.compute_logprobs(per_dp, temperature=1.0)
        flat = [mb for rank in per_dp for mb in rank]
        (lp,) = unpack_per_sample(flat, [t for rank in out for t, _ in rank], 1)
        return [float(x) for x in lp[len(prompt_ids):]]

"""`MegatronRewardModel`: a reward model trained on the trainer ranks (mlrl.jobs.rm).

The critic's model (mlrl.trainer.rank.critic: the policy's architecture, LM head replaced by a
scalar head, replicated across TP, fp32; here drawn as transformers draws a new classifier head)
with the policy's optimizer settings (trainer.lr, ...) and its own role ("reward_model": its
checkpoints load into nothing else). What differs from the critic is where the score is read: the
critic's value of a token is the head output one position earlier (the state it was generated in);
a reward model's score of a sequence is the head output AT its last token, the position vLLM's
pooling runner reads (and transformers' `*ForSequenceClassification`, for a sequence without a
pad-id tail: mlrl.jobs.rm.strip_pad_tail). So `_token_values`
returns the head output per position, unshifted; the loss (mlrl.algorithms.rm_loss) picks each
sequence's last one.

    MegatronRewardModel(model_cfg, parallel, trainer_cfg, layout, *, hf_dir, trainable=True)
      .compute_scores(micro_batches) -> [per-position scores [S] fp32 per micro-batch]
      .update(micro_batches, rm_loss_fn, *, step=True) -> metrics dict
      .score_weight() -> the head's weight [1, hidden] on the last pipeline stage, None elsewhere

Context parallelism is refused by validation (each rank would hold a slice of the positions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, cast

import torch

from mlrl.algorithms.rm_loss import RMLossFn
from mlrl.config.schema import ModelConfig, ParallelConfig, TrainerConfig
from mlrl.config.validate import Layout
from mlrl.experience.batch import MicroBatch
from mlrl.trainer.rank.critic import MegatronCritic, ValueHead
from mlrl.trainer.rank.inputs import ModelInputs
from mlrl.trainer.rank.policy import LossFn, MegatronPolicy

__all__ = ["MegatronRewardModel"]


class MegatronRewardModel(MegatronCritic):
    role = "reward_model"

    def __init__(self, model_cfg: ModelConfig, parallel: ParallelConfig, trainer_cfg: TrainerConfig, layout: Layout,
                 *, hf_dir: Path | str, trainable: bool = True):
        if layout.cp > 1:
            raise ValueError(f"a reward model reads each sequence's last position: parallel.cp={layout.cp} is not "
                             "supported")
        MegatronPolicy.__init__(self, model_cfg, parallel, trainer_cfg, layout, hf_dir=hf_dir, trainable=trainable)

    def _build_chunks(self) -> list[torch.nn.Module]:
        """The critic's chunks, with the head drawn as transformers initialises a new classifier's
        `score` (normal, std = config.json's initializer_range, 0.02 by default): a zero head would
        give the body no gradient until Adam has grown it (measured on SmolLM2-135M at lr 2e-5: held-out
        accuracy 0.61 after 24 steps). Drawn from trainer.seed on the CPU, so every TP rank holds the
        same head and a run repeats exactly."""
        chunks = super()._build_chunks()
        std = float(self.hf_config.get("initializer_range") or 0.02)
        gen = torch.Generator().manual_seed(self.trainer_cfg.seed)
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, ValueHead):
                    w = torch.randn(tuple(module.weight.shape), generator=gen, dtype=torch.float32) * std
                    with torch.no_grad():
                        module.weight.copy_(w.to(module.weight.dtype))
        return chunks

    def _optimizer_hparams(self) -> dict[str, Any]:
        return MegatronPolicy._optimizer_hparams(self)  # trainer.lr, ...: the model being trained

    def _token_values(self, output: torch.Tensor, inp: ModelInputs, temperature: float) -> tuple[torch.Tensor, ...]:
        """GPTModel output through the scalar head ([1, S', 1], fp32) -> (scores [S],): position t's
        is the score of the sequence up to and including token t."""
        return (output[0, : inp.length, 0],)

    def compute_scores(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Per-position scores [S] (fp32) per micro-batch, on every rank of this DP rank's
        model-parallel group."""
        return [v for (v,) in self._forward_token_values(micro_batches, 1.0)]

    def compute_values(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:  # not a critic
        raise TypeError("MegatronRewardModel scores sequences: use compute_scores")

    def update(self, micro_batches: list[MicroBatch], rm_loss_fn: RMLossFn, *,  # type: ignore[override]
               step: bool = True) -> dict[str, float]:
        """One optimizer update; `rm_loss_fn(mb, scores [S]) -> (loss, metrics)`
        (mlrl.algorithms.rm_loss.make_rm_loss_fn). Returns what MegatronPolicy.update returns."""
        return MegatronPolicy.update(self, micro_batches, cast(LossFn, rm_loss_fn), step=step)

    def score_weight(self) -> Optional[torch.Tensor]:
        """The scalar head's weight [1, hidden] (replicated across TP) on the last pipeline stage's
        ranks; None on the others."""
        for chunk in self.model:  # DDP / Float16Module wrap the GPTModel whose output_layer it is
            for module in chunk.modules():
                if isinstance(module, ValueHead):
                    return module.weight.detach()
        return None

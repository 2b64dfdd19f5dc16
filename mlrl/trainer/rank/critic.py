"""`MegatronCritic`: the PPO value model on the trainer ranks (build, load, values, train step).

GAE needs V(s_t) for every generated token. The critic is the policy's architecture built by the
same code (`MegatronPolicy`'s hooks: GPTModel with the local spec on CPU / TE on GPU, TP / PP /
DP / EP, DDP, Megatron optimizer, checkpoints) with one change: on the last pipeline stage the
LM head is replaced by a scalar value head. Runs inside every torchrun rank, SPMD: every method is
a collective over all trainer ranks, with the policy's conventions (each DP rank passes its own
micro-batches, the ranks of one DP rank's model-parallel group the same list).

    MegatronCritic(model_cfg, critic_cfg, parallel, trainer_cfg, layout, *, hf_dir)
      .compute_values(micro_batches) -> [values [S] fp32 per micro-batch]
      .update(micro_batches, value_loss_fn, *, step=True) -> metrics dict
      .iter_hf_buckets(bucket_bytes) -> the body's HF tensors (the value head is not an HF tensor)
      .rank_info() / .sharded_state_dict() / .optimizer / .scheduler / .optimizer_steps

Invariants:
- Initial weights: the body equals the HF checkpoint's body bit for bit (every tensor but the
  lm_head, which is never read); the value head starts at zero, so initial values are exactly 0.
- Alignment (mlrl.experience.batch): values[t] = head output at position t-1 = V(tokens[<t]),
  the value of the state in which token t was generated; the first token of each sample and
  padding get 0 (`align_to_tokens`, as for logprobs). The head output of a sample's last
  position (the state after its final token) is dropped: GAE treats it as terminal, V = 0.
- Values do not depend on the layout. The head (hidden -> 1) is replicated across TP, not
  vocab-parallel. Without sequence parallelism every TP rank sees every position and computes
  the same values and the same head gradient. With it each TP rank holds a sequence slice of the
  last hidden states: the head output is all-gathered along the sequence (backward: each rank
  keeps its slice's gradient) and the head weight is marked `sequence_parallel`, so Megatron's
  finalize_model_grads sums its gradient over TP (as verl's and slime's Megatron critics do).
- Loss and gradients: `value_loss_fn(mb, values)` returns its micro-batch's share of the step
  loss (mlrl.algorithms.value), gradients are summed over micro-batches and DP ranks: the policy's
  contract (policy.py), so the update does not depend on the split.
- Optimizer: critic.lr / min_lr / lr_schedule / lr_warmup_steps (in critic updates) /
  weight_decay / grad_clip; optimizer kind, betas, eps and the distributed optimizer come from
  trainer, the precision from model.dtype; decay over trainer.total_steps * mini_batches_per_step *
  epochs_per_step.
- Checkpoints: mlrl.trainer.rank.dist_ckpt.save_checkpoint / load_checkpoint take a critic as
  they take a policy; its role is recorded, so neither loads into the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, cast

import torch

from mlrl.algorithms.value import ValueLossFn
from mlrl.config.schema import CriticConfig, ModelConfig, ParallelConfig, TrainerConfig
from mlrl.config.validate import Layout
from mlrl.experience.batch import MicroBatch
from mlrl.trainer.rank.inputs import ModelInputs
from mlrl.trainer.rank.model import build_model_chunks, params_dtype
from mlrl.trainer.rank.policy import LossFn, MegatronPolicy

__all__ = ["MegatronCritic", "ValueHead"]


class ValueHead(torch.nn.Linear):
    """hidden -> 1 (no bias), replicated across TP, computed in fp32. Stands in for GPTModel's
    `output_layer` and keeps its call signature: (hidden [s, b, h], weight=None,
    runtime_gather_output=None) -> (values [S, b, 1], None), S the whole sequence even when the
    input is this rank's sequence-parallel slice."""

    def __init__(self, hidden_size: int, *, sequence_parallel: bool, dtype: torch.dtype, device: torch.device):
        super().__init__(hidden_size, 1, bias=False, dtype=dtype, device=device)
        torch.nn.init.zeros_(self.weight)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            # each TP rank's gradient covers only its tokens: finalize_model_grads sums it over TP
            self.weight.sequence_parallel = True  # pyright: ignore[reportAttributeAccessIssue]  # read by megatron

    # output_layer's signature, not torch.nn.Linear's
    def forward(self, hidden: torch.Tensor, weight: Optional[torch.Tensor] = None,  # pyright: ignore[reportIncompatibleMethodOverride]
                runtime_gather_output: Optional[bool] = None) -> tuple[torch.Tensor, None]:
        out = torch.nn.functional.linear(hidden.float(), self.weight.float())
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            # every TP rank then computes the same loss on the whole row: backward keeps this
            # rank's slice of the output gradient (split), it does not reduce-scatter
            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
        return out, None


class MegatronCritic(MegatronPolicy):
    role = "critic"
    TOKEN_VALUES = 1  # per-token outputs of `_token_values`: (value,)
    LM_HEAD = False   # the value head is neither loaded from nor exported to the HF checkpoint
    LORA = False      # model.lora adapts the policy only: the critic trains all its weights

    def __init__(self, model_cfg: ModelConfig, critic_cfg: CriticConfig, parallel: ParallelConfig,
                 trainer_cfg: TrainerConfig, layout: Layout, *, hf_dir: Path | str):
        self.critic_cfg = critic_cfg  # read by _optimizer_hparams during the build
        super().__init__(model_cfg, parallel, trainer_cfg, layout, hf_dir=hf_dir, trainable=True)

    # ---- construction hooks ----------------------------------------------------------------------
    def _build_chunks(self) -> list[torch.nn.Module]:
        # untied: the head must not be (a copy of) the embedding, also with PP (no embedding group reduction)
        assert self.spec is not None  # None only on the megatron-bridge path, which builds its own chunks
        chunks = build_model_chunks(self.spec, self.arch, self.config, self.layout,
                                    overrides={"share_embeddings_and_output_weights": False})
        for chunk in chunks:
            if chunk.post_process:
                # before DDP wraps the chunk: the head's gradient must live in DDP's buffers
                chunk.output_layer = ValueHead(self.arch.hidden_size, sequence_parallel=self.config.sequence_parallel,
                                               dtype=params_dtype(self.model_cfg), device=self.device)
        return chunks

    def _load_head(self, ckpt, chunks: list[torch.nn.Module]) -> None:
        """Started from a reward model's export (critic.hf_dir = a one-label *ForSequenceClassification,
        the usual RLHF start: OpenRLHF, DeepSpeed-Chat): its score head is the value head's start, so
        the initial value of a state is the reward model's score of the sequence so far."""
        if not self.score_head_folder:
            return
        from mlrl.bridge.arch import SCORE_WEIGHT

        score = ckpt.read([SCORE_WEIGHT])[SCORE_WEIGHT]
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, ValueHead):
                    with torch.no_grad():
                        module.weight.copy_(score.to(module.weight.dtype))

    def _optimizer_hparams(self) -> dict[str, Any]:
        c = self.critic_cfg
        return dict(lr=c.lr, min_lr=c.min_lr, lr_schedule=c.lr_schedule, lr_warmup_steps=c.lr_warmup_steps,
                    weight_decay=c.weight_decay, grad_clip=c.grad_clip)

    def _token_values(self, output: torch.Tensor, inp: ModelInputs, temperature: float) -> tuple[torch.Tensor, ...]:
        """GPTModel output through the value head ([1, S', 1], fp32) -> (values [S],)."""
        return self._align_to_tokens(inp, output[0, :, 0])

    # ---- the critic's interface ---------------------------------------------------------------------
    def compute_values(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Values [S] (fp32, token-aligned, first token of each sample and padding 0) per
        micro-batch, on every rank of this DP rank's model-parallel group."""
        return [v for (v,) in self._forward_token_values(micro_batches, 1.0)]

    def update(self, micro_batches: list[MicroBatch], value_loss_fn: ValueLossFn, *,  # type: ignore[override]
                   step: bool = True) -> dict[str, float]:
        """One critic optimizer update; `value_loss_fn(mb, values [S]) -> (loss, metrics)`
        (mlrl.algorithms.value.make_value_loss_fn). Returns, identical on every rank, loss and
        the loss metrics summed over micro-batches and DP ranks, grad_norm, lr, tokens,
        loss_tokens, num_micro_batches, skipped, time_s (as MegatronPolicy.update)."""
        # called as value_loss_fn(mb, values): one per-token output (TOKEN_VALUES = 1)
        return super().update(micro_batches, cast(LossFn, value_loss_fn), step=step)

    def compute_logprobs(self, micro_batches, temperature, *, router="default"):  # not a distribution
        raise TypeError("MegatronCritic has no token distribution: use compute_values")

    def compute_logits(self, micro_batches):
        raise TypeError("MegatronCritic has no token distribution: use compute_values")

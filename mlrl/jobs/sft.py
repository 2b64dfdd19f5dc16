"""Supervised fine-tuning: `python -m mlrl.launch --config launch/sft_cpu.yaml` (a config with an
`sft:` section) trains the policy on chat demonstrations with the RL trainer's own parts.

    rows (data.train via HF datasets / files / synthetic tasks) -> chat template -> (input_ids,
    loss_mask on assistant tokens) -> sft.batch_size conversations per step -> the same token-budget
    packer as RL (DP split, micro-batches of trainer.micro_batch_tokens) -> the Megatron policy's
    update with the SFT loss (token-mean NLL of the assistant tokens over the whole step) on the
    same trainer ranks (TP / PP / DP) -> metrics, eval loss on data.eval every data.eval_every steps,
    checkpoints (exact resume: weights, optimizer, data position) and the HF export at the end.

No engines start: an SFT run is the trainer alone. Everything that can fail cheaply (model folder,
chat template, data, model.init_from) fails before any process starts. The result starts an RL run
as `model.init_from=<run>/checkpoints/step_N` (or `model.init_from=<run>/hf/step_N`, its HF export;
or `model.hf_dir=<run>/hf/step_N`). An SFT run can itself start from another run with model.init_from.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

from mlrl.config import Config, ConfigError, Layout
from mlrl.config.schema import SFTConfig
from mlrl.data.registry import SFTDataset
from mlrl.experience.packing import pack_step
from mlrl.jobs.offline import load_splits, run_offline
from mlrl.trainer.driver.client import TrainerClient
from mlrl.types import Sample

log = logging.getLogger("mlrl.jobs.sft")
KIND = "sft"  # recorded in the checkpoint's loop state: an RL run does not resume an SFT checkpoint


def load_sft_data(cfg: Config, hf_dir: Path) -> tuple[SFTDataset, SFTDataset | None]:
    """The tokenised train (and eval) examples; rows without an assistant turn are skipped with a
    warning naming them; a tokenizer without a chat template is a ConfigError."""
    out = []
    for which, ds in load_splits(cfg, hf_dir, "sft", _sft_section(cfg).max_seq_tokens):
        if ds is not None and ds.no_assistant:
            log.warning("data.%s: skipped %d row(s) without an assistant turn, e.g. %s", which, len(ds.no_assistant),
                        "; ".join(ds.no_assistant[:3]))
        if ds is not None and ds.skipped:
            log.warning("data.%s: skipped %d malformed row(s), e.g. %s", which, len(ds.skipped), ds.skipped[0])
        out.append(ds)
    return out[0], out[1]


def samples_of(examples: Sequence[dict[str, list[int]]]) -> list[Sample]:
    return [Sample(tokens=list(e["input_ids"]), loss_mask=list(e["loss_mask"]),
                   rollout_logprobs=[0.0] * len(e["input_ids"]), versions=[-1] * len(e["input_ids"]))
            for e in examples]


def eval_loss(policy: TrainerClient, examples: Sequence[dict[str, list[int]]], token_budget: int) -> float:
    """Token-mean NLL of the assistant tokens of `examples` (forward only, every DP rank a share)."""
    per_dp, _ = pack_step(samples_of(examples), dp_size=policy.dp_size, token_budget=token_budget,
                          loss_agg="token-mean")
    out = policy.compute_logprobs(per_dp, 1.0)
    nll = tokens = 0.0
    for rank_mbs, rank_out in zip(per_dp, out):
        for mb, (lp, _) in zip(rank_mbs, rank_out):
            nll -= float((lp * mb.loss_mask).sum())
            tokens += float(mb.loss_mask.sum())
    return nll / max(tokens, 1.0)


def _sft_section(cfg: Config) -> SFTConfig:
    if cfg.sft is None:
        raise ConfigError("an SFT run needs an `sft:` section (see mlrl/config/schema.py SFTConfig)")
    return cfg.sft


class SFTJob:
    """Supervised fine-tuning for `mlrl.jobs.offline.run_offline`."""

    kind, title = KIND, "SFT"

    def __init__(self, cfg: Config, hf_dir: Path):
        sft = _sft_section(cfg)
        self.train, self.held_out = load_sft_data(cfg, hf_dir)
        self.batch_size, self.token_budget = sft.batch_size, cfg.trainer.token_budget
        log.info("SFT: %d training conversations (%d cut at sft.max_seq_tokens=%d), %s held out%s", len(self.train),
                 self.train.truncated, sft.max_seq_tokens, len(self.held_out) if self.held_out else "none",
                 f" ({self.held_out.truncated} cut)" if self.held_out else "")

    def step(self, policy: TrainerClient, batch: list[Any]) -> dict[str, Any]:
        per_dp, pack = pack_step(samples_of(batch), dp_size=policy.dp_size, token_budget=self.token_budget,
                                 loss_agg="token-mean")
        m = policy.update(per_dp)
        return {"sft/loss": m["loss"], "sft/entropy": m.get("entropy", float("nan")),
                "train/grad_norm": m["grad_norm"], "train/lr": m["lr"],
                "sft/loss_tokens": pack["pack/num_loss_tokens"], "sft/tokens": pack["pack/num_tokens"]}

    def evaluate(self, policy: TrainerClient) -> dict[str, float] | None:
        if self.held_out is None:
            return None
        return {"eval/loss": eval_loss(policy, self.held_out.examples, self.token_budget)}


def run(cfg: Config, layout: Layout) -> int:
    _sft_section(cfg)
    return run_offline(cfg, layout, lambda hf_dir: SFTJob(cfg, hf_dir))

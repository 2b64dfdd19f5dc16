"""Preference optimisation, DPO / IPO: `python -m mlrl.launch --config launch/dpo_cpu.yaml` (a
config with a `dpo:` section) trains the policy on offline (prompt, chosen, rejected) pairs with
the RL trainer's own parts.

    rows (data.train: jsonl / parquet / HF datasets in TRL's preference formats, or a synthetic task
    whose rejected side is a wrong answer) -> tokens + completion masks (mlrl.data.preference) ->
    dpo.batch_size pairs per step -> samples [chosen_0, rejected_0, chosen_1, ...], each pair packed
    whole into one micro-batch (pack_step(whole_groups=True), DP split, trainer.micro_batch_tokens)
    -> the frozen reference's token logprobs on those micro-batches (the trainer's reference model,
    the one RL's KL uses; with LoRA the base with adapters off) -> the Megatron policy's update
    with the DPO / IPO loss (mlrl.algorithms.dpo_loss) on the same trainer ranks (TP / PP / DP) ->
    metrics (dpo/loss, the implicit rewards, reward margin and accuracy), the same metrics on
    data.eval every data.eval_every steps, checkpoints (exact resume) and the HF export.

No engines start. Everything that can fail cheaply (model folder, chat template, data) fails before
any process starts (mlrl.jobs.offline). The result starts an RL run as `model.init_from=<checkpoint>`
or `model.hf_dir=<run>/hf/step_N`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Sequence

from mlrl.algorithms.dpo_loss import make_dpo_loss_fn
from mlrl.algorithms.loss_metrics import combine_loss_metrics, finalize_loss_metrics
from mlrl.config import Config, ConfigError, Layout
from mlrl.config.schema import DPOConfig
from mlrl.data.preference import Side
from mlrl.data.registry import PreferenceDataset
from mlrl.experience.packing import pack_step
from mlrl.interfaces import PerDP
from mlrl.jobs.offline import load_splits, run_offline
from mlrl.trainer.driver.client import TrainerClient
from mlrl.types import Sample

log = logging.getLogger("mlrl.jobs.dpo")
KIND = "dpo"  # recorded in the checkpoint's loop state
PAIR_METRICS = ("chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy", "chosen_logprob",
                "rejected_logprob")


def _dpo_section(cfg: Config) -> DPOConfig:
    if cfg.dpo is None:
        raise ConfigError("a DPO run needs a `dpo:` section (see mlrl/config/schema.py DPOConfig)")
    return cfg.dpo


def load_preference_data(cfg: Config, hf_dir: Path) -> tuple[PreferenceDataset, PreferenceDataset | None]:
    """The tokenised train (and eval) pairs of a DPO or reward-model run, cut at its section's
    max_seq_tokens; bad rows are a ConfigError naming the row (skipped with a warning under
    data.skip_malformed)."""
    section = cfg.offline_section
    if section is None or not cfg.trains_on_pairs:
        raise ConfigError("preference pairs are read by a run with a `dpo:` or `rm:` section")
    out: list[PreferenceDataset | None] = []
    for which, ds in load_splits(cfg, hf_dir, "dpo", section.max_seq_tokens):
        if ds is not None and ds.skipped:
            log.warning("data.%s: skipped %d malformed pair(s), e.g. %s", which, len(ds.skipped), ds.skipped[0])
        out.append(ds)
    train = out[0]
    assert train is not None  # data.train is required (validated)
    return train, out[1]


def _sample(side: Side, pair: int) -> Sample:
    ids, mask = side
    return Sample(tokens=list(ids), loss_mask=list(mask), rollout_logprobs=[0.0] * len(ids),
                  versions=[-1] * len(ids), group_id=f"pair{pair}")


def samples_of(pairs: Sequence[dict[str, Side]]) -> list[Sample]:
    """[chosen_0, rejected_0, chosen_1, ...]: sample 2k is pair k's chosen side, 2k + 1 its rejected one."""
    return [_sample(p[side], k) for k, p in enumerate(pairs) for side in ("chosen", "rejected")]


def pack_pairs(pairs: Sequence[dict[str, Side]], dp_size: int, token_budget: int) -> tuple[PerDP, dict[str, float]]:
    """The step's micro-batches per DP rank, each pair whole in one; token weights 1 / (2 * pairs)."""
    return pack_step(samples_of(pairs), dp_size=dp_size, token_budget=token_budget, loss_agg="seq-mean-token-sum",
                     whole_groups=True)


def attach_reference(policy: TrainerClient, per_dp: PerDP) -> None:
    """MicroBatch.ref_logprobs from the frozen reference, on the micro-batches as packed."""
    for rank_mbs, rank_out in zip(per_dp, policy.compute_logprobs(per_dp, 1.0, reference=True)):
        for mb, (lp, _) in zip(rank_mbs, rank_out):
            mb.ref_logprobs = lp


class DPOJob:
    """Preference optimisation for `mlrl.jobs.offline.run_offline`."""

    kind, title = KIND, "DPO"

    def __init__(self, cfg: Config, hf_dir: Path):
        self.cfg = _dpo_section(cfg)
        self.train, self.held_out = load_preference_data(cfg, hf_dir)
        self.batch_size, self.token_budget = self.cfg.batch_size, cfg.trainer.token_budget
        self.loss_fn = make_dpo_loss_fn(self.cfg.beta, self.cfg.loss_type)  # the ranks' loss, for held-out metrics
        log.info("DPO (%s, beta %g): %d training pairs (%d cut at dpo.max_seq_tokens=%d), %s held out%s",
                 self.cfg.loss_type, self.cfg.beta, len(self.train), self.train.truncated, self.cfg.max_seq_tokens,
                 len(self.held_out) if self.held_out else "none",
                 f" ({self.held_out.truncated} cut)" if self.held_out else "")

    def step(self, policy: TrainerClient, batch: list[Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        per_dp, pack = pack_pairs(batch, policy.dp_size, self.token_budget)
        attach_reference(policy, per_dp)
        t1 = time.perf_counter()
        m = policy.update(per_dp)
        out: dict[str, Any] = {"dpo/loss": m["loss"], "train/grad_norm": m["grad_norm"], "train/lr": m["lr"],
                               "dpo/entropy": m.get("entropy", float("nan")), "dpo/pairs": m.get("n_pairs", 0.0),
                               "dpo/tokens": pack["pack/num_tokens"], "dpo/loss_tokens": pack["pack/num_loss_tokens"],
                               "timing/reference": t1 - t0, "timing/train": time.perf_counter() - t1}
        out.update({f"dpo/{k}": m[k] for k in PAIR_METRICS if k in m})
        return out

    def evaluate(self, policy: TrainerClient) -> dict[str, float] | None:
        """The DPO loss and pair metrics of the held-out pairs (forward passes only), with the ranks' own
        loss function applied to the policy's and the reference's logprobs."""
        if self.held_out is None:
            return None
        per_dp, _ = pack_pairs(self.held_out.examples, policy.dp_size, self.token_budget)
        attach_reference(policy, per_dp)
        parts: list[dict] = []
        for rank_mbs, rank_out in zip(per_dp, policy.compute_logprobs(per_dp, 1.0)):
            for mb, (lp, ent) in zip(rank_mbs, rank_out):
                loss, metrics = self.loss_fn(mb, lp, ent)
                parts.append({"loss": loss.detach(), **metrics})
        m = finalize_loss_metrics(combine_loss_metrics(parts))
        return {"eval/dpo_loss": m["loss"], **{f"eval/{k}": m[k] for k in PAIR_METRICS if k in m}}


def run(cfg: Config, layout: Layout) -> int:
    _dpo_section(cfg)
    return run_offline(cfg, layout, lambda hf_dir: DPOJob(cfg, hf_dir))

"""Reward-model training: `python -m mlrl.launch --config launch/rm_cpu.yaml` (a config with an `rm:`
section) trains a reward model on offline preference pairs with the RL trainer's own parts, for an
RL run to score with (RLHF: SFT -> reward model -> RL, as NeMo-RL's and OpenRLHF's RM training).

    rows (data.train: the DPO formats of mlrl.data.preference) -> tokens -> rm.batch_size pairs per
    step -> samples [chosen_0, rejected_0, ...], each pair whole in one micro-batch (the DPO packing,
    mlrl.jobs.dpo.pack_pairs) -> the Megatron reward model (mlrl.trainer.rank.reward_model: the
    policy's architecture, a fresh scalar head in place of the LM head) updated with the
    Bradley-Terry loss (mlrl.algorithms.rm_loss) on the trainer ranks (TP / PP / DP) -> metrics
    (rm/loss, rm/accuracy, the chosen / rejected scores and their margin), the same on data.eval
    every data.eval_every steps, checkpoints (exact resume) and the HF export: a one-label
    `*ForSequenceClassification` folder.

An RL run serves the export as its reward: `reward_model: {kind: classifier, hf_dir: <run>/hf/step_N}`
with `workflow.reward: reward_model` (mlrl.reward.model.ClassifierJudge renders the question as the
user turn and the response as the assistant turn with the chat template, as conversational rows are
rendered here, and takes sigmoid(score)). No engines start; everything that can fail cheaply fails
before any process starts (mlrl.jobs.offline).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from mlrl.algorithms.loss_metrics import combine_loss_metrics, finalize_loss_metrics
from mlrl.algorithms.rm_loss import make_rm_loss_fn
from mlrl.ckpt_files.hf_folder import classifier_pad_id as export_pad_id
from mlrl.config import Config, ConfigError, Layout
from mlrl.config.schema import RMConfig
from mlrl.data.preference import Side
from mlrl.data.registry import PreferenceDataset
from mlrl.jobs.dpo import load_preference_data, pack_pairs
from mlrl.jobs.offline import run_offline
from mlrl.trainer.driver.client import TrainerClient

log = logging.getLogger("mlrl.jobs.rm")
KIND = "rm"  # recorded in the checkpoint's loop state
# loss-metric key -> the run's metric (rm/<name>, eval/rm_<name>)
NAMES = {"chosen_score": "chosen_score", "rejected_score": "rejected_score", "score_margin": "margin",
         "pair_accuracy": "accuracy"}


def classifier_pad_id(hf_dir: Path) -> int | None:
    """The pad token id the export's config.json will name (mlrl.ckpt_files.hf_folder.sequence_classifier_config)."""
    return export_pad_id(json.loads((Path(hf_dir) / "config.json").read_text()))


def strip_pad_tail(side: Side, pad_id: int | None) -> Side:
    """A sequence without its trailing pad-id tokens. transformers' `*ForSequenceClassification` scores
    a sequence at its last token that is NOT the pad id, vLLM's pooling runner at its last token, and
    the trainer at its last token: with every sequence ending in a non-pad token (here, and in what
    mlrl.reward.model.ClassifierJudge sends) the three read the same position. A string row's
    appended EOS is the pad id when the model pads with EOS (SmolLM2; the export's default)."""
    ids, mask = side
    n = len(ids)
    while pad_id is not None and n > 1 and ids[n - 1] == pad_id:
        n -= 1
    return list(ids[:n]), list(mask[:n])


def _stripped(ds: PreferenceDataset, pad_id: int | None) -> PreferenceDataset:
    return dataclasses.replace(ds, examples=[{k: strip_pad_tail(v, pad_id) for k, v in ex.items()}
                                             for ex in ds.examples])


def _rm_section(cfg: Config) -> RMConfig:
    if cfg.rm is None:
        raise ConfigError("a reward-model run needs an `rm:` section (see mlrl/config/schema.py RMConfig)")
    return cfg.rm


class RewardModelJob:
    """Reward-model training for `mlrl.jobs.offline.run_offline`."""

    kind, title = KIND, "RM"

    def __init__(self, cfg: Config, hf_dir: Path):
        self.cfg = _rm_section(cfg)
        train, held_out = load_preference_data(cfg, hf_dir)
        pad_id = classifier_pad_id(hf_dir)
        self.train = _stripped(train, pad_id)
        self.held_out = _stripped(held_out, pad_id) if held_out is not None else None
        self.batch_size, self.token_budget = self.cfg.batch_size, cfg.trainer.token_budget
        self.loss_fn = make_rm_loss_fn(self.cfg.center_rewards_coefficient)  # the ranks' loss, for held-out metrics
        log.info("reward model (Bradley-Terry%s): %d training pairs (%d cut at rm.max_seq_tokens=%d), %s held out%s",
                 f", centred {self.cfg.center_rewards_coefficient:g}" if self.cfg.center_rewards_coefficient else "",
                 len(self.train), self.train.truncated, self.cfg.max_seq_tokens,
                 len(self.held_out) if self.held_out else "none",
                 f" ({self.held_out.truncated} cut)" if self.held_out else "")

    def step(self, policy: TrainerClient, batch: list[Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        per_dp, pack = pack_pairs(batch, policy.dp_size, self.token_budget)
        m = policy.update(per_dp)
        out: dict[str, Any] = {"rm/loss": m["loss"], "train/grad_norm": m["grad_norm"], "train/lr": m["lr"],
                               "rm/pairs": m.get("n_pairs", 0.0), "rm/tokens": pack["pack/num_tokens"],
                               "timing/train": time.perf_counter() - t0}
        out.update({f"rm/{name}": m[k] for k, name in NAMES.items() if k in m})
        return out

    def evaluate(self, policy: TrainerClient) -> dict[str, float] | None:
        """The loss and pair metrics of the held-out pairs (forward passes only), with the ranks' own
        loss function applied to the reward model's scores."""
        if self.held_out is None:
            return None
        per_dp, _ = pack_pairs(self.held_out.examples, policy.dp_size, self.token_budget)
        parts: list[dict] = []
        for rank_mbs, rank_scores in zip(per_dp, policy.compute_scores(per_dp)):
            for mb, scores in zip(rank_mbs, rank_scores):
                loss, metrics = self.loss_fn(mb, scores)
                parts.append({"loss": loss.detach(), **metrics})
        m = finalize_loss_metrics(combine_loss_metrics(parts))
        return {"eval/rm_loss": m["loss"], **{f"eval/rm_{name}": m[k] for k, name in NAMES.items() if k in m}}


def run(cfg: Config, layout: Layout) -> int:
    _rm_section(cfg)
    return run_offline(cfg, layout, lambda hf_dir: RewardModelJob(cfg, hf_dir))

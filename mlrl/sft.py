"""Supervised fine-tuning: `python -m mlrl.launch --config launch/sft_cpu.yaml` (a config with an
`sft:` section) trains the policy on chat demonstrations with the RL trainer's own parts.

    rows (data.train via HF datasets / files / synthetic tasks) -> chat template -> (input_ids,
    loss_mask on assistant tokens) -> sft.batch_size conversations per step -> the same token-budget
    packer as RL (DP split, micro-batches of trainer.micro_batch_tokens) -> the Megatron policy's
    train_step with the SFT loss (token-mean NLL of the assistant tokens over the whole step) on the
    same trainer ranks (TP / PP / DP) -> metrics, eval loss on data.eval every data.eval_every steps,
    checkpoints (exact resume: weights, optimizer, data position) and the HF export at the end.

No engines start: an SFT run is the trainer alone. Everything that can fail cheaply (model folder,
chat template, data, model.init_from) fails before any process starts. The result starts an RL run
as `model.init_from=<run>/checkpoints/step_N` (or `model.init_from=<run>/hf/step_N`, its HF export;
or `model.hf_dir=<run>/hf/step_N`). An SFT run can itself start from another run with model.init_from.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from mlrl.checkpoint import Checkpointer, CheckpointManager, read_state
from mlrl.checkpoint.init_from import check_model_init_from
from mlrl.config import Config, ConfigError, Layout, dump_yaml
from mlrl.config.schema import SFTConfig
from mlrl.data import get_dataset
from mlrl.data.registry import SFTDataset
from mlrl.data.rows import DatasetError
from mlrl.data.sampler import PromptSampler
from mlrl.experience.packing import pack_step
from mlrl.metrics import MetricsLogger
from mlrl.modelzoo import resolve_model_dir
from mlrl.trainer.driver.client import TrainerClient
from mlrl.trainer.driver.group import TrainerGroup, rank_env
from mlrl.types import Sample
from mlrl.workflow import load_hf_tokenizer

log = logging.getLogger("mlrl.sft")
KIND = "sft"  # recorded in the checkpoint's loop state: an RL run does not resume an SFT checkpoint


def load_sft_data(cfg: Config, hf_dir: Path) -> tuple[SFTDataset, SFTDataset | None]:
    """The tokenised train (and eval) examples; rows without an assistant turn are skipped with a
    warning naming them; a tokenizer without a chat template is a ConfigError."""
    sft = _sft_section(cfg)
    tokenizer = load_hf_tokenizer(str(hf_dir))
    out = []
    for which, name, split in (("train", cfg.data.train, "train"), ("eval", cfg.data.eval, "test")):
        if not name:
            out.append(None)
            continue
        synthetic = str(name).startswith("synthetic:")
        try:
            ds = get_dataset(name, split, "sft", tokenizer, sft.max_seq_tokens,
                             skip_malformed=cfg.data.skip_malformed, seed=cfg.trainer.seed,
                             num_rows=cfg.data.num_synthetic if synthetic else None)
        except DatasetError as e:
            raise ConfigError(f"data.{which}: {e}") from None
        except ValueError as e:
            if "chat template" in str(e).lower() or "chat_template" in str(e):
                raise ConfigError(f"model.hf_dir: the tokenizer of {hf_dir} has no chat template, which renders the "
                                  f"conversations of data.{which} ({name}); add one (chat_template in "
                                  "tokenizer_config.json or chat_template.jinja)") from None
            raise
        if ds.no_assistant:
            log.warning("data.%s: skipped %d row(s) without an assistant turn, e.g. %s", which, len(ds.no_assistant),
                        "; ".join(ds.no_assistant[:3]))
        if ds.skipped:
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


def run_sft(cfg: Config, layout: Layout) -> int:
    sft = _sft_section(cfg)
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    from mlrl.run import Placement

    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # 1. cheap checks first: model, chat template, data, checkpoint to resume
    hf_dir = resolve_model_dir(cfg.model.hf_dir)
    train, held_out = load_sft_data(cfg, hf_dir)
    ckpts = CheckpointManager(cfg.checkpoint.dir or run_dir / "checkpoints", cfg.checkpoint.keep_last)
    resume = ckpts.resolve_resume(cfg.checkpoint.resume)
    state = read_state(resume) if resume else None
    if state is not None and state.get("kind") != KIND:
        raise ConfigError(f"checkpoint.resume: {resume} is an RL checkpoint; an SFT run resumes SFT checkpoints "
                          f"(to fine-tune from its weights: model.init_from={resume} in a new run directory)")
    check_model_init_from(cfg.model, hf_dir, resume=resume)
    sampler = PromptSampler(train.examples, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    if state:
        sampler = PromptSampler.from_state(train.examples, state["sampler"], seed=cfg.trainer.seed,
                                           shuffle=cfg.data.shuffle)
    log.info("SFT: %d training conversations (%d cut at sft.max_seq_tokens=%d), %s held out", len(train),
             train.truncated, sft.max_seq_tokens, len(held_out) if held_out else "none")
    # 2. the trainer ranks (no engines)
    placement = Placement()  # this machine; on GPU the trainer ranks take every visible device (no engines)
    group = logger = None
    try:
        group = TrainerGroup(dump_yaml(cfg), layout.trainer_devices, run_dir=run_dir, host=placement.host,
                             env=rank_env(cfg, placement.trainer_env), spawn=placement.spawn_trainer)
        policy = TrainerClient(group)
        checkpointer = Checkpointer(ckpts, run_dir, policy)
        start = 0
        if resume and state is not None:
            checkpointer.load(resume)
            start = int(state["step"])
            log.info("resumed from %s (step %d)", resume, start)
        logger = MetricsLogger(run_dir, jsonl=cfg.logging.jsonl, tensorboard=cfg.logging.tensorboard,
                               wandb_project=cfg.logging.wandb_project, resume_step=start)
        total, c = cfg.trainer.total_steps, cfg.checkpoint
        for step in range(start + 1, total + 1):
            t0 = time.perf_counter()
            batch = sampler.next_batch(sft.batch_size)
            per_dp, pack = pack_step(samples_of(batch), dp_size=policy.dp_size,
                                     token_budget=cfg.trainer.micro_batch_tokens, loss_agg="token-mean")
            m = policy.train_step(per_dp)
            metrics: dict[str, Any] = {
                "sft/loss": m["loss"], "sft/entropy": m.get("entropy", float("nan")),
                "train/grad_norm": m["grad_norm"], "train/lr": m["lr"], "sft/loss_tokens": pack["pack/num_loss_tokens"],
                "sft/tokens": pack["pack/num_tokens"], "sft/epoch": float(sampler.state()["epoch"]),
                "timing/train": time.perf_counter() - t0,
            }
            last = step == total
            if held_out is not None and cfg.data.eval_every and (step % cfg.data.eval_every == 0 or last):
                t = time.perf_counter()
                metrics["eval/loss"] = eval_loss(policy, held_out.examples, cfg.trainer.micro_batch_tokens)
                metrics["timing/eval"] = time.perf_counter() - t
            t = time.perf_counter()
            if (c.save_every and step % c.save_every == 0) or (last and c.save_at_end):
                checkpointer.save(step, {"kind": KIND, "step": step, "sampler": sampler.state()})
            if (c.hf_export_every and step % c.hf_export_every == 0) or (last and c.hf_export_at_end):
                checkpointer.export_hf(step)
            metrics["timing/checkpoint"] = time.perf_counter() - t
            metrics["timing/step"] = time.perf_counter() - t0
            logger.log(step, metrics)
            log.info("SFT step %d/%d: loss %.4f%s", step, total, metrics["sft/loss"],
                     f", eval loss {metrics['eval/loss']:.4f}" if "eval/loss" in metrics else "")
        checkpointer.finalize()
        print(f"SFT finished: {total - start} steps, metrics in {run_dir / 'metrics.jsonl'}")
        if checkpointer.last_saved:
            print(f"checkpoint: {checkpointer.last_saved}  (start RL from it: model.init_from=<this folder>)")
        if checkpointer.last_export:
            print(f"Hugging Face export: {checkpointer.last_export}  (start RL from it: model.hf_dir=<this folder>)")
        return 0
    finally:
        if logger is not None:
            logger.close(plot=cfg.logging.plot)
        if group is not None:
            group.close()
        placement.close()

"""The loop of a run of the trainer alone on a fixed dataset: supervised fine-tuning (mlrl.jobs.sft),
preference optimisation (mlrl.jobs.dpo) and reward-model training (mlrl.jobs.rm). What differs between
them is an `OfflineJob` (its data, one step, its held-out evaluation); the rest is here, once:

    cheap checks (model folder, data, checkpoint to resume, model.init_from) before any process ->
    the trainer ranks (no engines) -> per step: job.step(batch) -> held-out eval every
    data.eval_every steps -> checkpoints (exact resume: weights, optimizer, data position) and HF
    exports on schedule -> metrics.

A checkpoint records its kind ("sft" / "dpo" / "rm"): a run resumes only checkpoints of its own kind.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Literal, Protocol, Sequence

from mlrl.checkpoint import Checkpointer, CheckpointManager, read_state
from mlrl.checkpoint.init_from import check_model_init_from, check_resume_same_start
from mlrl.checkpoint.schedule import saves_due
from mlrl.config import Config, ConfigError, Layout, dump_yaml
from mlrl.data import get_dataset
from mlrl.data.rows import DatasetError
from mlrl.data.sampler import PromptSampler
from mlrl.jobs.model_folder import chat_template_error, check_model_weights, model_tokenizer
from mlrl.jobs.placement import Placement
from mlrl.metrics import MetricsLogger
from mlrl.metrics.console import configure_logging, progress_bar
from mlrl.modelzoo import resolve_model_dir
from mlrl.trainer.driver.client import TrainerClient
from mlrl.trainer.driver.group import TrainerGroup, rank_env

log = logging.getLogger("mlrl.jobs.offline")


def load_splits(cfg: Config, hf_dir: Path, kind: Literal["sft", "dpo"],
                max_seq_tokens: int) -> list[tuple[str, Any]]:
    """[("train", dataset), ("eval", dataset or None)]: data.train and data.eval (its "test" split)
    tokenised for `kind` with the model's tokenizer. A bad row or a tokenizer without a chat
    template is a ConfigError naming the field, before any process starts."""
    tokenizer = model_tokenizer(hf_dir)
    out: list[tuple[str, Any]] = []
    for which, name, split in (("train", cfg.data.train, "train"), ("eval", cfg.data.eval, "test")):
        if not name:
            out.append((which, None))
            continue
        synthetic = str(name).startswith("synthetic:")
        try:
            ds = get_dataset(name, split, kind, tokenizer, max_seq_tokens, skip_malformed=cfg.data.skip_malformed,
                             seed=cfg.trainer.seed, num_rows=cfg.data.num_synthetic if synthetic else None)
        except DatasetError as e:
            raise ConfigError(f"data.{which}: {e}") from None
        except ValueError as e:
            if (err := chat_template_error(e, hf_dir, which, name)) is not None:
                raise err from None
            raise
        out.append((which, ds))
    return out


class OfflineJob(Protocol):
    @property
    def kind(self) -> str:
        """"sft" | "dpo" | "rm": recorded in checkpoints, names the metrics."""
        ...

    @property
    def title(self) -> str:
        """For messages: "SFT", "DPO", "RM"."""
        ...

    @property
    def train(self) -> Sequence[Any]:
        """The training examples (the sampler's items)."""
        ...

    @property
    def batch_size(self) -> int:
        """Examples per optimizer step."""
        ...

    def step(self, policy: TrainerClient, batch: list[Any]) -> dict[str, Any]:
        """One optimizer step on `batch`; its metrics ("<kind>/loss" among them)."""
        ...

    def evaluate(self, policy: TrainerClient) -> dict[str, float] | None:
        """The held-out metrics ("eval/..."), or None without held-out data."""
        ...


TERMINATED_EXIT = 128 + signal.SIGTERM  # the shell's code for a process ended by SIGTERM (as an RL run's)


class _Terminated(BaseException):
    """SIGTERM (Slurm's scancel / time limit, `kill`), raised where the run is: its teardown runs."""


def run_offline(cfg: Config, layout: Layout, make_job: Callable[[Path], OfflineJob]) -> int:
    """Run `make_job(hf_dir)`'s job to trainer.total_steps; 0 on success, 143 when SIGTERM stopped it
    (torn down: a checkpoint whose shards are written committed, the ranks stopped, metrics closed)."""
    configure_logging(cfg.logging.level)
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        return _run_offline(cfg, layout, make_job)

    def on_sigterm(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the teardown short
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return _run_offline(cfg, layout, make_job)
    except _Terminated:
        print(f"terminated (SIGTERM): trainer ranks stopped; metrics up to the last finished step in "
              f"{cfg.logging.run_dir}", file=sys.stderr)
        return TERMINATED_EXIT
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_offline(cfg: Config, layout: Layout, make_job: Callable[[Path], OfflineJob]) -> int:

    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # 1. cheap checks first: model, data, checkpoint to resume
    hf_dir = resolve_model_dir(cfg.model.hf_dir)
    check_model_weights(hf_dir)
    job = make_job(hf_dir)
    ckpts = CheckpointManager(cfg.checkpoint.dir or run_dir / "checkpoints", cfg.checkpoint.keep_last)
    resume = ckpts.resolve_resume(cfg.checkpoint.resume)
    state = read_state(resume) if resume else None
    ckpts.check_start(int(state["step"]) if state else 0)
    if state is not None and state.get("kind") != job.kind:
        named = {"sft": "an SFT", "dpo": "a DPO", "rm": "a reward-model"}
        saved = str(state.get("kind"))
        if saved == "rm":  # a reward model starts nothing: it scores RL runs
            hint = ("a reward model is no policy: an RL run scores with its HF export (reward_model.kind=classifier, "
                    "reward_model.hf_dir=<its run>/hf/step_N)")
        elif job.kind == "rm":  # a reward-model run starts from an HF folder (model.init_from is refused)
            hint = "to train a reward model on its weights: model.hf_dir=<its run>/hf/step_N in a new run directory"
        else:
            hint = f"to fine-tune from its weights: model.init_from={resume} in a new run directory"
        raise ConfigError(f"checkpoint.resume: {resume} is {named.get(saved, 'an RL')} checkpoint; "
                          f"{named[job.kind]} run resumes {job.title} checkpoints ({hint})")
    source = check_model_init_from(cfg.model, hf_dir, resume=resume)
    if resume:
        check_resume_same_start(resume, hf_dir, source, reference=cfg.dpo is not None)
    sampler = PromptSampler(job.train, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    if state:
        try:
            sampler = PromptSampler.from_state(job.train, state["sampler"], seed=cfg.trainer.seed,
                                               shuffle=cfg.data.shuffle)
        except ValueError as e:
            raise ConfigError(f"checkpoint.resume: {resume}: {e}") from None
    # 2. the trainer ranks (no engines)
    placement = Placement()  # this machine; on GPU the trainer ranks take every visible device (no engines)
    group = logger = bar = checkpointer = None
    try:
        group = TrainerGroup(dump_yaml(cfg), layout.trainer_devices, run_dir=run_dir, host=placement.host,
                             env=rank_env(cfg, placement.trainer_env), spawn=placement.spawn_trainer,
                             start_timeout_s=cfg.trainer.startup_timeout_s)
        policy = TrainerClient(group)
        checkpointer = Checkpointer(ckpts, run_dir, policy, async_save=cfg.checkpoint.async_save)
        start = 0
        if resume and state is not None:
            checkpointer.load(resume)
            start = int(state["step"])
            log.info("resumed from %s (step %d)", resume, start)
            if ckpts.owns(resume) and checkpointer.export_left_undone(cfg.checkpoint, start, cfg.trainer.total_steps,
                                                                      lora=cfg.model.lora is not None):
                log.warning("the HF export due at step %d is missing (the last run stopped during it): written now",
                            start)
                checkpointer.export_hf(start)
        logger = MetricsLogger(run_dir, jsonl=cfg.logging.jsonl, tensorboard=cfg.logging.tensorboard,
                               wandb_project=cfg.logging.wandb_project, resume_step=start)
        total, c, kind = cfg.trainer.total_steps, cfg.checkpoint, job.kind
        bar = progress_bar(cfg.logging.progress_bar, total=total, initial=start, desc=f"{kind.upper()} steps")
        save_s = 0.0  # the last save / export's seconds, reported in the next step's line
        for step in range(start + 1, total + 1):
            t0 = time.perf_counter()
            metrics = job.step(policy, sampler.next_batch(job.batch_size))
            metrics[f"{kind}/epoch"] = float(sampler.state()["epoch"])
            metrics.setdefault("timing/train", time.perf_counter() - t0)
            last = step == total
            if cfg.data.eval_every and (step % cfg.data.eval_every == 0 or last):
                t = time.perf_counter()
                held_out = job.evaluate(policy)
                if held_out is not None:
                    metrics.update(held_out)
                    metrics["timing/eval"] = time.perf_counter() - t
            # the step's line first, then its checkpoint (as the RL loop: a checkpoint never exists for a
            # step whose line is missing; a stop during the save or export used to lose the line for
            # good, the resumed run starting after it); the save's time goes in the next step's line
            metrics["timing/checkpoint"], save_s = save_s, 0.0
            metrics["timing/step"] = time.perf_counter() - t0
            logger.log(step, metrics)
            evals = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("eval/"))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{metrics[f'{kind}/loss']:.4f}")
            log.info("%s step %d/%d: loss %.4f%s", job.title, step, total, metrics[f"{kind}/loss"],
                     f", {evals}" if evals else "")
            t = time.perf_counter()
            checkpointer.finalize(blocking=False)  # an async save whose shards are written is committed
            save, export = saves_due(c, step, total)
            if save:
                checkpointer.save(step, {"kind": kind, "step": step, "sampler": sampler.state()})
            if export:
                checkpointer.export_hf(step)
            save_s = time.perf_counter() - t
        checkpointer.finalize()
        print(f"{job.title} finished: {total - start} steps, metrics in {run_dir / 'metrics.jsonl'}")
        if save_s:
            print(f"final checkpoint / export: {save_s:.2f} s")
        if kind == "rm":  # a reward model scores an RL run; it does not start one
            if checkpointer.last_saved:
                print(f"checkpoint: {checkpointer.last_saved}  (resume: checkpoint.resume=<this folder>)")
            if checkpointer.last_export:
                print(f"Hugging Face export: {checkpointer.last_export}  (score an RL run with it: "
                      "workflow.reward=reward_model reward_model.kind=classifier reward_model.hf_dir=<this folder>)")
        else:
            if checkpointer.last_saved:
                print(f"checkpoint: {checkpointer.last_saved}  (start RL from it: model.init_from=<this folder>)")
            if checkpointer.last_export:
                print(f"Hugging Face export: {checkpointer.last_export}  "
                      "(start RL from it: model.hf_dir=<this folder>)")
        return 0
    finally:
        if checkpointer is not None:  # interrupted or failed: an async save already written is kept
            checkpointer.finish_pending()
        if bar is not None:
            bar.close()
        # run.png is drawn in a thread while the trainer ranks stop
        drawn = logger.close(plot=cfg.logging.plot, wait=False) if logger is not None else None
        try:
            if group is not None:
                group.close()
            placement.close()
        finally:
            if drawn is not None:
                drawn.result()

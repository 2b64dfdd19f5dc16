"""The evaluation job's body (mlrl.jobs.evaluate, which prestarts the engines before importing
this): checks, engines, the episodes, the answers file and the metrics."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlrl.ckpt_files.atomic import write_json_atomic
from mlrl.config import Config, ConfigError
from mlrl.jobs.evaluate import partial_path
from mlrl.jobs.model_folder import check_model_weights, check_stop_tokens, model_tokenizer
from mlrl.jobs.rl_start import EarlyStart
from mlrl.jobs.rollout_parts import activate_judge, build_workflow, cancel_all, judge_folder, judge_pool, prompt_rows
from mlrl.metrics import MetricsLogger
from mlrl.metrics.console import progress_bar
from mlrl.metrics.pass_at_k import pass_metrics
from mlrl.reward.model import set_active_judge
from mlrl.workflow import EpisodeRunner
from mlrl.workflow.answers import AnswerWriter
from mlrl.workflow.failures import FailureGuard
from mlrl.workflow.runner import GroupResult, summarize

log = logging.getLogger("mlrl")


async def evaluate(cfg: Config, early: EarlyStart, output: Path, stage: dict[str, str] | None = None) -> int:
    """`stage["at"]`: "answering" once the answers file is open, "done" once it is complete."""
    assert cfg.evaluate is not None
    stage = {} if stage is None else stage
    hf_dir, run_dir, pool = early.hf_dir, Path(cfg.logging.run_dir), early.pool
    k, threshold = cfg.eval.samples_per_prompt, cfg.eval.correct_threshold
    judges = runner = logger = None
    try:
        # 1. cheap checks, while the engines import vLLM: model folder, tokenizer, workflow, data, judge
        tokenizer = model_tokenizer(hf_dir)
        check_model_weights(hf_dir, bin_ok=True)  # (vLLM alone loads it)
        check_stop_tokens(cfg.rollout.sampling, tokenizer)
        workflow = build_workflow(cfg, tokenizer)
        rows = first_prompts(prompt_rows(cfg, "eval", tokenizer, hf_dir, workflow), cfg.evaluate.max_prompts)
        if not rows:
            raise ConfigError(f"data.eval={cfg.data.describe('eval')}: no prompt to evaluate (every row was left out; "
                              "see the warnings above)")
        judge_dir, judge_tokenizer = judge_folder(cfg)
        output.parent.mkdir(parents=True, exist_ok=True)
        if cfg.logging.jsonl and (run_dir / "metrics.jsonl").is_file():
            log.warning("%s holds a metrics.jsonl already (another run's?): the evaluation appends its step 0 to it; "
                        "give the evaluation a logging.run_dir of its own to keep them apart", run_dir)
        # 2. the engines: the policy's, and the judge's on the GPUs after them
        assert pool is not None and early.placement is not None  # (one machine: validation)
        devices = early.placement.engine_devices
        if judge_dir is not None:
            judges = judge_pool(cfg, judge_dir, devices[cfg.rollout.num_engines:] if devices else None, run_dir)
        starts = [asyncio.create_task(pool.start())] + ([asyncio.create_task(judges.start())] if judges else [])
        try:
            for t in starts:
                await t
        except BaseException:  # a failed start or SIGTERM: the other start is not left running (engines stop below)
            await cancel_all(starts)
            raise
        if judges is not None and judge_dir is not None:
            activate_judge(cfg, judges, judge_dir, judge_tokenizer)
        runner = EpisodeRunner.from_config(cfg.workflow, workflow, pool, seed=cfg.rollout.sampling.seed)
        # 3. every prompt k times; the answers written in prompt order as the groups finish
        logger = MetricsLogger(run_dir, jsonl=cfg.logging.jsonl, tensorboard=cfg.logging.tensorboard,
                               wandb_project=cfg.logging.wandb_project)
        t0 = time.time()
        partial = partial_path(output)  # renamed to `output` when complete: an earlier evaluation's file stays whole
        with open(partial, "w") as f:
            stage["at"] = "answering"
            groups = await answer(runner, rows, k, AnswerWriter(f, tokenizer, threshold),
                                  progress_bar(cfg.logging.progress_bar, total=len(rows), initial=0,
                                               desc="evaluation prompts"))
            os.fsync(f.fileno())
        os.replace(partial, output)
        stage["at"] = "done"
        seconds = time.time() - t0
        metrics = {**{f"eval/{name}": v for name, v in summarize(groups).items()}, **pass_metrics(groups, k, threshold),
                   "eval/prompts": float(len(rows)), "eval/samples_per_prompt": float(k), "eval/seconds": seconds}
        write_json_atomic(run_dir / "eval_metrics.json", {"model": str(hf_dir), "data": cfg.data.describe("eval"),
                                                          "output": str(output), "metrics": metrics})
        logger.log(0, metrics)
        # like a training step: a run whose episodes fail is reported as failed (after its files are written)
        FailureGuard(cfg.workflow.max_failure_fraction, 1, outcome="the evaluation is reported as failed").observe(
            0, groups, label="the evaluation")
        at_k = f", pass@{k} {metrics['eval/pass@k']:.4f}" if k > 1 else ""
        print(f"evaluation of {hf_dir} on {cfg.data.describe('eval')}: {len(rows)} prompts x {k} in {seconds:.1f} s: "
              f"pass@1 {metrics['eval/pass@1']:.4f}{at_k}, mean reward {metrics['eval/mean_reward']:.4f}\n"
              f"answers: {output}\nmetrics: {run_dir / 'eval_metrics.json'}")
        return 0
    finally:
        if logger is not None:
            logger.close()
        if runner is not None:
            await runner.aclose()
        if pool is not None:
            await pool.shutdown()
        set_active_judge(None)
        if judges is not None:
            await judges.shutdown()


def first_prompts(ds: Any, n: int) -> list[dict[str, Any]]:
    """evaluate.max_prompts: the first `n` prompts (0 = all); of each source, for a mixture (data.mix)."""
    spans = getattr(ds, "sources", None)
    if not n:
        return list(ds)
    if not spans:
        return list(ds)[:n]
    return [ds[i] for s in spans for i in range(s.start, s.start + min(n, s.size))]


async def answer(runner: EpisodeRunner, rows: Sequence[dict[str, Any]], k: int, writer: "AnswerWriter",
                 progress: Any = None) -> list[GroupResult]:
    """k episodes of each row (evaluation mode), all in flight together (bounded by the runner's
    workflow.max_concurrency); each group's answers are written as soon as it and every group
    before it have finished."""
    done: dict[int, GroupResult] = {}
    written = 0

    async def one(i: int, row: dict[str, Any]) -> None:
        nonlocal written
        done[i] = await runner.run_group(row, k, evaluation=True)
        if progress is not None:
            progress.update(1)
        while written in done:
            writer.write(written, done[written])
            written += 1

    try:
        await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))
    finally:
        if progress is not None:
            progress.close()
    return [done[i] for i in range(len(rows))]

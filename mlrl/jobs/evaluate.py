"""The evaluation job (`evaluate:` section): the engines alone answer the prompts of data.eval.

What NeMo-RL's `run_eval.py` and verl's generation + evaluation scripts do, on mlrl's own parts:
the policy's vLLM engines serve model.hf_dir (an HF folder, e.g. a run's export), the configured
workflow runs each prompt eval.samples_per_prompt times (multi-turn and agent workflows too) and
its reward (or the reward_model judge on its own engines) scores every answer. Written:
- `evaluate.output` (default `<run_dir>/eval_samples.jsonl`): one JSON line per answer, in prompt
  order, appended to `<output>.partial` as the groups finish and renamed to `output` at the end (a
  stopped evaluation keeps the prompts it finished there; an earlier evaluation's file stays whole);
- `<run_dir>/eval_metrics.json`, written whole at the end (atomically): eval/pass@1, pass@k (the
  unbiased estimator), mean reward and the rollout metrics; also step 0 of metrics.jsonl /
  TensorBoard / W&B.
Like a training run, an evaluation with more than workflow.max_failure_fraction of its episodes
failed (or all of them) exits 1 with the first failure, after writing both files.

The engines start first (gated, `mlrl.jobs.rl_start.begin`) and import vLLM while this job's own
imports and checks run; a failed check stops them.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from mlrl.config import Config, Layout
from mlrl.jobs.rl_start import EarlyStart, begin


def run(cfg: Config, layout: Layout) -> int:
    early = begin(cfg, layout)
    from mlrl.jobs.rollout_parts import TERMINATED_EXIT, until_sigterm
    from mlrl.metrics.console import configure_logging
    from mlrl.workflow.failures import EpisodeFailures

    configure_logging(cfg.logging.level)
    terminated: list[bool] = []
    stage = {"at": "starting"}  # evaluate_run.evaluate moves it to "answering", then "done" (the SIGTERM message)
    try:
        return asyncio.run(until_sigterm(lambda: _run(cfg, early, stage), terminated))
    except EpisodeFailures as e:
        print(f"evaluation failed: {e}\nanswers in {output_path(cfg)}, metrics in {cfg.logging.run_dir}",
              file=sys.stderr)
        return 1
    except asyncio.CancelledError:
        if not terminated:
            raise
        out = output_path(cfg)
        partial = partial_path(out)
        where = {"starting": f"no prompt was answered; {out} is left as it was",
                 "answering": f"the answers of the prompts finished so far are in {partial} ({out} is left as it was)",
                 "done": f"the evaluation had finished: its answers are in {out}"}[stage["at"]]
        print(f"terminated (SIGTERM): engines stopped; {where}", file=sys.stderr)
        return TERMINATED_EXIT


def output_path(cfg: Config) -> Path:
    assert cfg.evaluate is not None
    return Path(cfg.evaluate.output) if cfg.evaluate.output else Path(cfg.logging.run_dir) / "eval_samples.jsonl"


def partial_path(output: Path) -> Path:
    """Where the answers are written while the evaluation runs (a stopped one leaves its finished prompts there)."""
    return output.with_name(output.name + ".partial")


async def _run(cfg: Config, early: EarlyStart, stage: dict[str, str]) -> int:
    from mlrl.jobs.evaluate_run import evaluate

    return await evaluate(cfg, early, output_path(cfg), stage)

"""What the jobs that generate (RL, evaluation) build alike before and around their engines: the
workflow, the prompt rows of data.train / data.eval, the judge's folder and engines, and the
SIGTERM handling that tears a run down in order. Imports no trainer code (an evaluation starts none).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mlrl.config import Config, ConfigError
from mlrl.data import dataset_from_config
from mlrl.data.registry import mix_rewards
from mlrl.jobs.model_folder import chat_template_error, check_model_weights, model_tokenizer
from mlrl.modelzoo import ModelSpecError, resolve_model_dir
from mlrl.registry import LookupFailed
from mlrl.reward.mixture import SourceReward
from mlrl.reward.model import ClassifierJudge, ModelJudge, set_active_judge
from mlrl.rollout.pool import EnginePool
from mlrl.workflow import build_workflow_from_config, gconfig_from_sampling

log = logging.getLogger("mlrl")

TERMINATED_EXIT = 128 + signal.SIGTERM  # the shell's code for a process ended by SIGTERM


async def until_sigterm(run: Callable[[], Awaitable[int]], terminated: list[bool]) -> int:
    """`run()`, with SIGTERM cancelling it: the run's `finally` tears everything down (reward process
    pool, engines, trainer ranks, Ray nodes, metrics sinks) instead of the process dying at once and
    leaving the reward pool's processes behind. `terminated` records that the cancellation came from
    SIGTERM."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None  # called from asyncio.run

    def on_sigterm() -> None:
        if terminated:  # a second SIGTERM (under Slurm the step and the batch script both pass one
            return      # on) must not cancel the teardown that the first one started
        terminated.append(True)
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await run()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel `tasks` and wait for them (a failed start does not leave the other starts running)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def build_workflow(cfg: Config, tokenizer: Any) -> Any:
    """The configured workflow; the registry's lookup / construction errors name workflow.name,
    .reward or .kwargs (an error inside the workflow keeps its traceback)."""
    try:
        # data.mix: each row's data_source picks its source's reward
        reward = SourceReward(mix_rewards(cfg.data, cfg.workflow.reward)) if cfg.data.mix else None
        return build_workflow_from_config(cfg.workflow, tokenizer=tokenizer,
                                          gconfig=gconfig_from_sampling(cfg.rollout.sampling), reward=reward)
    except LookupFailed as e:
        raise ConfigError(str(e)) from None


def prompt_rows(cfg: Config, which: str, tokenizer: Any, hf_dir: Path, workflow: Any) -> Any:
    """The RL dataset of data.<which> ("train" or "eval"), its prompts measured as the workflow
    renders them (rlvr's enable_thinking changes Qwen3's template); what loading left out is said."""
    try:
        ds = dataset_from_config(cfg.data, which, tokenizer=tokenizer, seed=cfg.trainer.seed,
                                 prompt_ids=getattr(workflow, "prompt_ids", None))
    except ValueError as e:  # (a DatasetError names its field itself)
        if (err := chat_template_error(e, hf_dir, which, cfg.data.describe(which))) is not None:
            raise err from None
        raise
    name = cfg.data.describe(which)
    if ds.reward and cfg.workflow.reward != ds.reward:  # a deliberate choice is allowed: said
        log.warning("data.%s=%s is made for the %r reward, and workflow.reward=%r scores it (set workflow.reward=%s "
                    "unless this is meant: a reward that cannot read the dataset's answers gives 0.0 everywhere)",
                    which, name, ds.reward, cfg.workflow.reward, ds.reward)
    if ds.too_long:
        log.warning("data.%s: left out %d of %d prompt(s) longer than data.max_prompt_tokens=%d (chat template "
                    "applied)", which, ds.too_long, ds.too_long + len(ds), cfg.data.max_prompt_tokens)
    if ds.skipped:
        log.warning("data.%s: skipped %d malformed row(s) (data.skip_malformed), e.g. %s", which,
                    len(ds.skipped), ds.skipped[0])
    return ds


def judge_folder(cfg: Config) -> tuple[Path | None, Any]:
    """The reward_model judge's folder and tokenizer, checked before any process starts (None, None
    without a judge)."""
    if cfg.reward_model is None:
        return None, None
    try:
        folder = resolve_model_dir(cfg.reward_model.hf_dir, field="reward_model.hf_dir")
    except ModelSpecError as e:
        raise ConfigError(str(e)) from None
    tokenizer = model_tokenizer(folder, field="reward_model.hf_dir")
    check_model_weights(folder, field="reward_model.hf_dir", bin_ok=True)  # (vLLM alone loads it)
    return folder, tokenizer


def judge_pool(cfg: Config, folder: Path, devices: list[list[int]] | None, run_dir: Path) -> EnginePool:
    """The judge's engine pool (not started): `devices`, the local GPUs left after the policy's engines."""
    rm = cfg.reward_model
    assert rm is not None
    return EnginePool(rm.engines(cfg.rollout), folder, dtype=cfg.model.dtype, run_dir=run_dir / "reward_model",
                      cuda_devices=devices, runner="pooling" if rm.kind == "classifier" else None)


def activate_judge(cfg: Config, pool: EnginePool, folder: Path, tokenizer: Any) -> None:
    """Make the started judge the one `workflow.reward=reward_model` scores with."""
    rm = cfg.reward_model
    assert rm is not None
    set_active_judge(
        ClassifierJudge(pool, tokenizer, pad_id=_pad_id(folder)) if rm.kind == "classifier" else
        ModelJudge(pool, tokenizer, prompt_template=rm.prompt_template, score_pattern=rm.score_pattern,
                   max_score=rm.max_score, max_tokens=rm.max_tokens))


def _pad_id(folder: Path) -> int | None:
    """config.json's pad_token_id of a classifier reward model (what transformers skips at the end)."""
    pad = json.loads((Path(folder) / "config.json").read_text()).get("pad_token_id")
    return pad if isinstance(pad, int) else None

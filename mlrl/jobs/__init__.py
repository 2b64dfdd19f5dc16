"""What `python -m mlrl.launch` runs: one module per kind of run, siblings, each building its run
from the shared components (config, placement, trainer group, checkpoints, metrics):

    rl       RL post-training (GRPO, PPO, ...): trainer ranks + vLLM engines + the loop (mlrl/loop.py)
    sft      supervised fine-tuning: the trainer alone on a fixed dataset (the `sft:` section)
    dpo      preference optimisation (DPO / IPO): the trainer alone (the `dpo:` section)

`offline` is the loop the trainer-only jobs share, `placement` where any job's processes go.
Each job module has `run(cfg, layout) -> exit code`; `job_for` picks the module from the config
(Config.offline), and only that job's imports are paid for (an SFT run never imports the engines).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from mlrl.config import Config, Layout

JOBS = ("rl", "sft", "dpo")


def job_name(cfg: Config) -> str:
    """The job a validated config describes: its offline kind ("sft", "dpo"), else "rl"."""
    return cfg.offline or "rl"


def job_for(cfg: Config) -> Callable[[Config, Layout], int]:
    """The `run` function of the job module for `cfg`."""
    return importlib.import_module(f"mlrl.jobs.{job_name(cfg)}").run

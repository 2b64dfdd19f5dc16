"""What `python -m mlrl.launch` runs: one module per kind of run, siblings, each building its run
from the shared components (config, placement, trainer group, checkpoints, metrics):

    rl       RL post-training (GRPO, PPO, ...): trainer ranks + vLLM engines + the loop (mlrl/loop.py)
    sft      supervised fine-tuning: the trainer alone on a fixed dataset (the `sft:` section)
    dpo      preference optimisation (DPO / IPO): the trainer alone (the `dpo:` section)
    rm       reward-model training (Bradley-Terry on preference pairs): the trainer alone (the `rm:` section)
    evaluate the engines alone answer data.eval, scored by the workflow's reward (the `evaluate:` section)

`offline` is the loop the trainer-only jobs share, `placement` where any job's processes go.
Each job module has `run(cfg, layout) -> exit code`; `job_for` picks the module from the config
(Config.offline), and only that job's imports are paid for (an SFT run never imports the engines).
The RL job is entered through `rl_start.run`, which starts its engines before importing `rl`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from mlrl.config import Config, Layout

JOBS = ("rl", "sft", "dpo", "rm", "evaluate")


def job_name(cfg: Config) -> str:
    """The job a validated config describes: its offline kind ("sft", "dpo", "rm"), "evaluate", else "rl"."""
    return cfg.offline or ("evaluate" if cfg.evaluate is not None else "rl")


# the module whose `run` a job enters by: the RL job's engines start (mlrl.jobs.rl_start) before
# the job module's own imports
ENTRY = {"rl": "rl_start"}


def job_for(cfg: Config) -> Callable[[Config, Layout], int]:
    """The `run` function the job for `cfg` enters by (importing only that module)."""
    name = job_name(cfg)
    return importlib.import_module(f"mlrl.jobs.{ENTRY.get(name, name)}").run

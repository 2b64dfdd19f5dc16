"""`model.init_from`, the driver's side: a run whose trainer starts from another run's weights (RL
after SFT), checked before any process starts and logged.

The check itself (`check_init_from`, `InitSource`: JSON files only) is mlrl.ckpt_files.init_source,
which the trainer ranks run again (the same verdict) to know which loader to use.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mlrl.ckpt_files.init_source import InitSource, check_init_from, read_json
from mlrl.config import ModelConfig

log = logging.getLogger(__name__)


def check_model_init_from(model: ModelConfig, hf_dir: Path, *, resume: Path | None) -> InitSource | None:
    """The driver's check (mlrl.jobs.rl, mlrl.jobs.sft: before any process starts), logged; None when
    model.init_from is off. On resume the checkpoint holds the policy's weights, but init_from is
    still checked: the trainer loads it for the KL reference and, with model.lora, the frozen base."""
    if model.init_from is None:
        return None
    source = check_init_from(model.init_from, read_json(Path(hf_dir) / "config.json"))
    if resume is not None:
        log.info("model.init_from=%s: ignored for the policy's weights (resuming %s, which holds them); it still gives "
                 "the KL reference and the LoRA base", source.path, resume)
    else:
        log.info("model.init_from: the trainer starts from the weights of %s %s (weights only: fresh optimizer, LR "
                 "schedule and data order)", source.what, source.path)
    return source

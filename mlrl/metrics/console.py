"""What a run prints while it runs, shared by the RL, SFT and DPO jobs: the log level
(logging.level) and the progress bar over the run's steps (logging.progress_bar)."""

from __future__ import annotations

import logging
import sys
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """The root logger on stderr at `level` (logging.level); httpx's one line per request only at
    WARNING and above."""
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def progress_bar(enabled: bool, *, total: int, initial: int, desc: str) -> Any:
    """A tqdm bar over the run's steps on stderr (logging.progress_bar), or None when off."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", file=sys.stderr)

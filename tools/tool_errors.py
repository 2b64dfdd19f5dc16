"""The rule every tool follows for bad input: one line naming the problem on stderr and exit 2,
before any rank, engine or run starts (no traceback). Tools import this as `tool_errors` (their
own folder is on sys.path when run as `python tools/<tool>.py`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

INPUT_ERROR = 2


def input_error_types() -> tuple[type[BaseException], ...]:
    """What mlrl raises for bad input: configs, model folders, bridges, datasets."""
    from mlrl.bridge import BridgeError
    from mlrl.config.loader import ConfigError
    from mlrl.data.rows import DatasetError
    from mlrl.modelzoo import ModelSpecError

    return ConfigError, ModelSpecError, BridgeError, DatasetError


class InputError(Exception):
    """Raised by a tool's own checks: the message is the line printed."""


def recipe_paths(recipes: str, repo: Path) -> list[Path]:
    """A `--recipes a.yaml,b.yaml` argument (relative to the repository) as paths that exist."""
    paths = [repo / r if not Path(r).is_absolute() else Path(r) for r in recipes.split(",") if r]
    for p in paths:
        if not p.is_file():
            raise InputError(f"recipe {p} does not exist")
    return paths


def run(name: str, main: Callable[[], int | None]) -> int:
    """main() with bad input turned into `<name>: <message>` on stderr and exit 2."""
    try:
        return int(main() or 0)
    except (InputError, *input_error_types()) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return INPUT_ERROR

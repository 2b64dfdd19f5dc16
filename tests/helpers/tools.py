"""The programs in tools/ loaded as modules (they are scripts, not part of the `mlrl` package)."""

import importlib.util
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py as a fresh module (its `main`, parsers and checks callable in-process)."""
    spec = importlib.util.spec_from_file_location(f"mlrl_tool_{name}", TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

"""The programs in tools/ loaded as modules (they are scripts, not part of the `mlrl` package)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py as a fresh module (its `main`, parsers and checks callable in-process), with
    tools/ on sys.path as when it runs as `python tools/<name>.py` (for its `import tool_errors`)."""
    if str(TOOLS) not in sys.path:
        sys.path.append(str(TOOLS))
    spec = importlib.util.spec_from_file_location(f"mlrl_tool_{name}", TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

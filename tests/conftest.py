"""Marks each test by its tier (its folder) and skips GPU tests without CUDA, with the reason."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    for item in items:
        tier = Path(str(item.fspath)).resolve().relative_to(ROOT).parts[0]
        if tier in ("unit", "integration", "gpu"):
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "gpu" and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine"))

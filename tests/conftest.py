"""Marks each test by its tier (its folder) and skips GPU tests without CUDA, with the reason; tells
pytest-xdist which tests must share a worker (below); ends the pytest process with pytest's own
exit code before native finalizers run (below)."""

import atexit
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    tiers = {item: Path(str(item.fspath)).resolve().relative_to(ROOT).parts[0] for item in items}
    has_cuda = False
    if "gpu" in tiers.values():  # torch only when a GPU test was collected: 1.5 s of every other session
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except ImportError:  # pragma: no cover
            pass
    for item, tier in tiers.items():
        if tier in ("unit", "integration", "gpu"):
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "gpu" and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine"))


# Two xdist workers share two cores with the processes their tests start, so torch's OpenMP threads
# in a worker's own process (the integration tests' Hugging Face reference forwards) spin-wait for a
# core those processes hold: measured while a suite ran, 30 tiny-llama forwards took 2.2-4.7 s wall
# and 1.9-2.5 CPU s on torch's 2 threads, 0.13-0.45 s and 0.07-0.13 CPU s on one. A worker's own torch
# therefore runs on one thread; the processes it starts (launches, ranks, engines) keep their settings.
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if os.environ.get("PYTEST_XDIST_WORKER") and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):  # torch first imported by a fixture
    pytest_runtest_setup(item)


# `make test` runs two pytest-xdist workers (`-n 2`); which tests must share one: helpers/workers.py.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from helpers.workers import work_unit
    from xdist.scheduler import LoadScopeScheduling

    class _Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return _Units(config, log)


# The suite's process imports torch, vLLM, megatron-core and Ray, joins Ray clusters and runs gloo
# groups in its own threads; once (CI, after "1618 passed") the interpreter's teardown of those native
# libraries (C++ static destructors, module teardown with their threads alive) died with SIGSEGV, so
# make reported a failure for a session whose every test had passed. Once pytest has finished
# (unconfigure and its cleanups done, the summary printed, the exit code decided), the process
# runs the other atexit handlers (ours was registered first, so it runs last) and then leaves with
# that exit code without native teardown. An exception escaping pytest itself leaves no code here
# and the interpreter exits as usual.
_EXIT_CODE: list[int] = []


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_cmdline_main(config):
    code = yield
    _EXIT_CODE.append(int(code))
    return code


def _leave_with_pytests_code() -> None:
    if _EXIT_CODE:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(_EXIT_CODE[-1])


atexit.register(_leave_with_pytests_code)

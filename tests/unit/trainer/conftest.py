"""Fixtures shared by the rank-side unit tests."""

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_gloo_rank(tmp_path_factory):
    """A one-process gloo group (the default group a rank-side function collects over), destroyed
    after the module's tests unless one was already up."""
    ours = not dist.is_initialized()
    if ours:
        store = tmp_path_factory.mktemp("store") / "f"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    if ours:  # not left to later tests (and to this process's teardown)
        dist.destroy_process_group()

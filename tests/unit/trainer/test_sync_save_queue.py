"""A synchronous checkpoint save (every save on CPU; on GPU with checkpoint.async_save off) starts no
process for its write results (mlrl.trainer.rank.dist_ckpt._in_process_results_queue).

megatron-core's torch_dist writer passes every save's results through a queue served by a
spawn-context multiprocessing Manager, made for its async path. For a synchronous save that
Manager is a fresh process at each rank's first save which imports torch to unpickle the results:
the CPU SFT run's final save took 4.1 s with it, 0.5 s without. Real megatron-core saves of a
sharded tensor on a one-process gloo group; the second half shows what megatron-core does without
the swap (the assertion above it can fail)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from mlrl.trainer.rank import dist_ckpt


@pytest.fixture(scope="module", autouse=True)
def rank(one_gloo_rank):
    from mlrl.trainer.rank import cpu_compat

    if cpu_compat.needed():  # what a rank applies first (megatron's writer syncs CUDA after its copies)
        cpu_compat.apply()


def _save(path, value: torch.Tensor) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    path.mkdir()
    strategy = dist_checkpointing.serialization.get_default_save_sharded_strategy("torch_dist")
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", value.clone())}, str(path),
                            sharded_strategy=strategy)


def _load(path) -> torch.Tensor:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    return dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8))}, str(path))["w"]


def test_a_synchronous_save_writes_through_an_in_process_queue(tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    children = set(multiprocessing.active_children())
    value = torch.arange(8, dtype=torch.float32)
    with dist_ckpt._in_process_results_queue():
        _save(tmp_path / "ours", value)
    assert set(multiprocessing.active_children()) == children  # no Manager (nor writer) left running
    assert filesystem_async._results_queue is None  # megatron's global is put back for a later async save
    assert torch.equal(_load(tmp_path / "ours"), value)

    # megatron-core on its own: the same save starts its Manager process and keeps it
    _save(tmp_path / "theirs", value)
    proxy = filesystem_async._results_queue
    try:
        assert proxy is not None and len(set(multiprocessing.active_children()) - children) == 1
        assert torch.equal(_load(tmp_path / "theirs"), value)
    finally:
        if proxy is not None:
            proxy._manager.shutdown()

"""mlrl.trainer.rank.offload's report on CPU, with a stand-in model (the attributes `model_tensors`
reads): the bytes it counts per kind and `measured`, the CUDA allocator's count of what left the
device, which is 0 where nothing lives on CUDA. The real Megatron models are offloaded in
tests/integration/trainer/test_offload.py, the CUDA measurement is checked in
tests/gpu/trainer/test_offload_gpu.py."""

import torch

from mlrl.trainer.driver.client import _offload_totals
from mlrl.trainer.rank.offload import Offloader


class _Model:
    def __init__(self):
        self.model = [torch.nn.Linear(8, 4)]  # 36 fp32 parameters in two storages
        for p in self.model[0].parameters():
            p.main_grad = torch.ones_like(p)
        self.optimizer = None


def test_cpu_offload_counts_its_bytes_and_measures_no_device_memory():
    m = _Model()
    before = [p.detach().clone() for p in m.model[0].parameters()]
    off = Offloader([m])
    rep = off.offload(["params", "grads"])
    assert rep.bytes == {"params": 36 * 4, "grads": 36 * 4} and rep.copied == 36 * 4  # grads are dropped
    assert rep.measured == 0 and rep.to_json()["measured"] == 0
    back = off.reload()
    assert back.bytes == rep.bytes and back.measured == 0
    assert all(torch.equal(p, q) for p, q in zip(m.model[0].parameters(), before))
    assert all(not p.main_grad.any() for p in m.model[0].parameters())  # gradients come back zeroed


def test_the_driver_sums_measured_bytes_over_ranks():
    per_rank = [{"bytes": {"params": 10}, "copied": 10, "measured": 12, "seconds": 0.5},
                {"bytes": {"params": 20}, "copied": 20, "measured": 24, "seconds": 0.25}]
    assert _offload_totals(per_rank) == {"params": 30.0, "copied": 30.0, "measured": 36.0, "seconds": 0.5}

"""GPU tier sanity: runs only where CUDA exists (skipped otherwise, with the reason)."""

import torch


def test_cuda_device_usable():
    x = torch.ones(4, device="cuda")
    assert float((x * 2).sum()) == 8.0

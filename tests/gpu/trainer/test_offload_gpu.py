"""Trainer offload on a CUDA device (skipped without CUDA): the bytes mlrl.trainer.rank.offload
reports are bytes the device gets back. A stand-in model laid out the way Megatron's DDP lays out
its state (every parameter a view into one contiguous buffer, `main_grad` views into a gradient
buffer) with a torch Adam's state: `measured` (torch.cuda.memory_allocated before minus after) is at
least the reported bytes, the driver's free memory (what a colocated vLLM engine can allocate)
grows by them, and reload brings back the same bytes. The Megatron models themselves are offloaded
on CPU in tests/integration/trainer/test_offload.py and on GPU by the colocated run of
tests/gpu/test_colocate_gpu.py (colocate/offload_measured_bytes)."""

import torch

from mlrl.trainer.rank.offload import Offloader

MiB = 1 << 20


class _MegatronLike:
    def __init__(self, dims=(2048, 2048, 2048)):
        dev = torch.device("cuda", torch.cuda.current_device())
        self.model = [torch.nn.Sequential(*(torch.nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:]))).to(dev)]
        params = list(self.model[0].parameters())
        n = sum(p.numel() for p in params)
        param_buf, grad_buf = torch.empty(n, device=dev), torch.zeros(n, device=dev)
        at = 0
        for p in params:
            k = p.numel()
            param_buf[at:at + k].copy_(p.data.reshape(-1))
            p.data = param_buf[at:at + k].view_as(p)
            p.main_grad = grad_buf[at:at + k].view_as(p)
            p.grad = torch.randn_like(p)
            at += k
        self.optimizer = torch.optim.Adam(params, lr=1e-3, capturable=True)  # capturable: `step` on the device too
        self.optimizer.step()  # creates exp_avg / exp_avg_sq / step on the device
        for p in params:
            p.grad = None


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_offload_frees_on_the_device_what_it_reports_and_reload_restores_it():
    m = _MegatronLike()
    before = [p.detach().clone() for p in m.model[0].parameters()]
    state = [v.clone() for s in m.optimizer.state.values() for v in s.values()]
    off = Offloader([m])
    free0 = _free()
    rep = off.offload(["params", "grads", "optimizer"])
    reported = sum(rep.bytes.values())
    assert rep.bytes["params"] == rep.bytes["grads"] == 2 * 2048 * 2048 * 4  # one buffer each
    assert rep.bytes["optimizer"] == 2 * rep.bytes["params"] + 2 * 4  # Adam's two moments, two fp32 `step`s
    # each released storage frees its whole allocator block (its size rounded up to 512 bytes)
    assert reported <= rep.measured <= reported + 512 * 8, (rep.measured, reported)
    # empty_cache handed the (large, single-tensor) segments back to the driver: another process can use them
    assert _free() - free0 >= reported - 16 * MiB, ((_free() - free0) / MiB, reported / MiB)
    back = off.reload()
    assert back.bytes == rep.bytes and reported <= back.measured <= reported + 512 * 8, (back.measured, reported)
    assert all(torch.equal(p, q) for p, q in zip(m.model[0].parameters(), before))
    assert all(torch.equal(v, w) for v, w in zip((v for s in m.optimizer.state.values() for v in s.values()), state))
    assert all(not p.main_grad.any() for p in m.model[0].parameters())

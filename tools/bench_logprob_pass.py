"""The trainer's logprob / entropy pass (mlrl.trainer.rank.logprobs) against the plain autograd
formula it replaced, side by side in one run: forward-only (the reference and old-policy pass)
and forward + backward (the train step), on the same logits.

    python tools/bench_logprob_pass.py [--device cpu|cuda] [--tokens 2048] [--vocab 49152] \
        [--dtype float32|bfloat16] [--repeats 5]

On CPU both run torch ops (mlrl's over row chunks); on CUDA mlrl's runs its Triton kernels. The
plain formula is the pre-#30 implementation: log-softmax pieces as separate fp32 tensors, the
backward by autograd. Prints ms per call of each, the peak memory on CUDA, and as its last line
`ratio plain_over_mlrl: x` (time of the plain formula / mlrl's, forward + backward; > 1 = mlrl
faster).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlrl.trainer.rank.logprobs import vocab_parallel_logprobs


def plain(logits: torch.Tensor, labels: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor]:
    z = logits.float()
    if t != 1.0:
        z = z / t
    m = z.max(dim=-1).values.detach()
    zs = z - m.unsqueeze(-1)
    e = zs.exp()
    picked = zs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    log_z = e.sum(-1).log()
    return picked - log_z, log_z - (e * zs).sum(-1) / e.sum(-1)


def mlrl(logits: torch.Tensor, labels: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor]:
    return vocab_parallel_logprobs(logits, labels, temperature=t, vocab_size=logits.shape[-1], tp_rank=0, tp_size=1)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, logits, labels, t, *, backward: bool, repeats: int, device: str) -> tuple[float, float]:
    """(ms per call, peak GB above the inputs on CUDA, else 0)."""
    w = torch.randn(labels.shape[0], device=logits.device)
    for i in range(repeats + 1):  # the first call warms up (Triton compile, allocator)
        if i == 1:
            _sync(device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
        x = logits.detach().requires_grad_(backward)
        if backward:
            lp, ent = fn(x, labels, t)
            (w * lp + 0.01 * w * ent).sum().backward()
        else:
            with torch.no_grad():
                fn(x, labels, t)
    _sync(device)
    ms = (time.perf_counter() - t0) / repeats * 1e3
    peak = (torch.cuda.max_memory_allocated() - base) / 1e9 if device == "cuda" else 0.0
    return ms, peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: expected >= 1 (the timed calls after the warm-up)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False on this machine")
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(args.tokens, args.vocab, generator=g)).to(getattr(torch, args.dtype)).to(args.device)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(args.device)
    res = {}
    for name, fn in (("plain", plain), ("mlrl", mlrl)):
        for backward in (False, True):
            res[name, backward] = _time(fn, logits, labels, args.temperature, backward=backward,
                                        repeats=args.repeats, device=args.device)
    for name in ("plain", "mlrl"):
        (f_ms, f_gb), (b_ms, b_gb) = res[name, False], res[name, True]
        mem = f", peak +{f_gb:.2f} / +{b_gb:.2f} GB" if args.device == "cuda" else ""
        print(f"bench_logprob_pass: {name:5s} {args.device} {args.dtype} [{args.tokens} x {args.vocab}]: forward "
              f"{f_ms:.1f} ms, forward+backward {b_ms:.1f} ms{mem}", flush=True)
    print(f"ratio plain_over_mlrl_forward: {res['plain', False][0] / res['mlrl', False][0]:.3f}")
    print(f"ratio plain_over_mlrl: {res['plain', True][0] / res['mlrl', True][0]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

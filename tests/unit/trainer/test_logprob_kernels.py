"""The Triton kernels of the GPU logprob pass (mlrl.trainer.rank.logprob_kernels), run on CPU by
Triton's interpreter in a subprocess (TRITON_INTERPRET=1 must be set before the kernels are
defined): values and gradients equal the torch path's at several block sizes (a ragged last
block, one block per row, several), temperatures, vocabulary padding, a shard that does not
hold every label (a TP rank's slice), and bf16 logits with a bf16 gradient."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r'''
import json
import torch
from mlrl.trainer.rank import logprob_kernels as K, logprobs as L
assert K.available(torch.zeros(1))
g = torch.Generator().manual_seed(0)
out = []
#        S, V (shard), valid, lo, label range, T, BLOCK, dtype
cases = [(7, 50, 50, 0, (0, 50), 1.0, 16, "float32"),
         (9, 40, 33, 0, (0, 33), 0.7, 16, "float32"),       # vocabulary padding, temperature
         (8, 30, 30, 30, (0, 90), 1.0, 8, "float32"),        # TP rank 1 of 3: most labels elsewhere
         (6, 37, 37, 0, (0, 37), 1.3, 64, "float32"),        # one block covers the row
         (6, 40, 40, 0, (0, 40), 1.0, 16, "bfloat16")]
for S, V, valid, lo, (a, b), t, block, dt in cases:
    K.BLOCK = block
    x = (3 * torch.randn(S, V, generator=g)).to(getattr(torch, dt)).requires_grad_()
    labels = torch.randint(a, b, (S,), generator=g)
    w1, w2 = torch.randn(S, generator=g), torch.randn(S, generator=g)
    res = {}
    for path in ("kernel", "torch"):
        K.available = (lambda _: True) if path == "kernel" else (lambda _: False)
        x.grad = None
        lp, ent = L._LogprobEntropy.apply(x, labels, t, lo, valid, 1, None)
        (w1 * lp + w2 * ent).sum().backward()
        res[path] = (lp.detach(), ent.detach(), x.grad.float().clone(), str(x.grad.dtype))
    k, r = res["kernel"], res["torch"]
    scale = float(r[2].abs().max())
    here = (labels >= lo) & (labels < lo + valid)  # alone, a rank's logprob is defined where it holds the label
    out.append({"case": [S, V, valid, lo, t, block, dt], "lp": float((k[0] - r[0])[here].abs().max()),
                "ent": float((k[1] - r[1]).abs().max()), "grad_rel": float((k[2] - r[2]).abs().max()) / scale,
                "pad_grad": float(k[2][:, valid:].abs().max()) if valid < V else 0.0, "grad_dtype": k[3]})
print(json.dumps(out))
'''


def test_kernels_match_the_torch_path_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in json.loads(proc.stdout.strip().splitlines()[-1]):
        bf16 = r["case"][-1] == "bfloat16"
        assert r["lp"] <= 2e-6 and r["ent"] <= 5e-6, r
        assert r["grad_rel"] <= (1e-2 if bf16 else 1e-5), r  # bf16: the gradient's own rounding
        assert r["pad_grad"] == 0.0 and r["grad_dtype"] == ("torch.bfloat16" if bf16 else "torch.float32"), r

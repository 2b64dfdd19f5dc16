"""cpu_compat mechanisms 7 and 8: on a CPU, megatron.core imports without `torch.compile` (which
imports torch._dynamo and inductor, ~2.6 CPU s of every rank's start) and without wandb (~0.9 s);
its jit-fused functions are the plain functions, as megatron's `disable_jit_fuser()` makes them,
`torch.compile` itself is left as it was and wandb imports afterwards. On a GPU nothing is patched."""

import json
import os
import subprocess
import sys
from unittest import mock

import torch

FRESH_RANK = r"""
import json, sys
import torch
compile_ = torch.compile
from mlrl.trainer.rank import cpu_compat
assert cpu_compat.apply()
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.transformer import utils
later_import = "megatron.core.activations" not in sys.modules
import megatron.core.activations as later  # decorated with jit_fuser as it was after apply()
from megatron.core.inference.contexts import dynamic_context
megatron_wandb = dynamic_context.wandb
wandb_before = "wandb" in sys.modules
import wandb
print(json.dumps({
    "dynamo": "torch._dynamo" in sys.modules,
    "inductor": "torch._inductor" in sys.modules,
    "noop_fuser": jit.jit_fuser is jit.noop_decorator,
    # torch.compile(fn) returns a wrapper of fn (functools.wraps: __wrapped__, _torchdynamo_orig_callable)
    "plain": [not hasattr(f, "_torchdynamo_orig_callable") and not hasattr(f, "__wrapped__")
              for f in (fused_bias_swiglu.swiglu, utils.gelu_impl, later.quick_gelu)],
    "compile_restored": torch.compile is compile_,
    "later_import": later_import,
    "megatron_wandb": megatron_wandb is None, "wandb_before": wandb_before, "wandb_after": wandb.__name__,
}))
"""


def _fresh_rank(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FRESH_RANK], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cpu_rank_imports_megatron_without_torch_compile():
    got = _fresh_rank()
    assert got["dynamo"] is False and got["inductor"] is False, got
    assert got["noop_fuser"] and got["plain"] == [True, True, True], got
    assert got["compile_restored"] and got["later_import"], got
    # megatron's inference logging saw no wandb; the rank itself can still import it
    assert got["megatron_wandb"] and not got["wandb_before"] and got["wandb_after"] == "wandb", got


def test_the_gpu_branch_leaves_torch_compile_and_megatron_alone():
    from mlrl.trainer.rank import cpu_compat

    compile_ = torch.compile
    with mock.patch.object(cpu_compat, "needed", return_value=False), \
            mock.patch.object(cpu_compat, "_eager_jit_fuser", side_effect=AssertionError("patched on a GPU")):
        assert cpu_compat.apply() is False
    assert torch.compile is compile_


def test_the_switch_keeps_megatrons_own_import():
    """MLRL_CPU_EAGER_FUSER=0 (tools/bench_rank_start.py's baseline): torch.compile'd functions, wandb."""
    got = _fresh_rank(MLRL_CPU_EAGER_FUSER="0")
    assert got["dynamo"] is True and got["noop_fuser"] is False and got["plain"] == [False, False, False], got
    assert got["megatron_wandb"] is False and got["wandb_before"] is True, got

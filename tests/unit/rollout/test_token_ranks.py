"""CPU engines rank the chosen tokens' logprobs eagerly (mlrl.rollout.worker_ext.eager_token_ranks_on_cpu)
with vLLM's own math, instead of its torch.compile'd helper (~1.8 s of inductor at an engine's first
logprobs request); GPU engines, and MLRL_EAGER_TOKEN_RANKS=0, keep vLLM's helper."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm.platforms import current_platform
from vllm.v1.sample import sampler
from vllm.v1.sample.ops import logprobs as ops

from mlrl.rollout import worker_ext
from mlrl.rollout.server import EAGER_RANKS_ENV


@pytest.fixture
def vllms_helper(monkeypatch):
    monkeypatch.setattr(sampler, "batched_count_greater_than", ops.batched_count_greater_than)
    monkeypatch.delenv(EAGER_RANKS_ENV, raising=False)


def test_a_cpu_engine_ranks_eagerly_with_vllms_result(vllms_helper):
    assert current_platform.is_cpu()
    assert worker_ext.eager_token_ranks_on_cpu()
    assert sampler.batched_count_greater_than is worker_ext.count_greater_equal
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 50, generator=g).log_softmax(-1)
    x[:, 10] = x[:, 3]  # ties count as "greater or equal", as in vLLM
    values = x.gather(1, torch.randint(0, 50, (7, 1), generator=g))
    values[0, 0] = x[0, 3]
    want = ops.batched_count_greater_than._torchdynamo_orig_callable(x, values)  # vLLM's function, uncompiled
    got = worker_ext.count_greater_equal(x, values)
    assert torch.equal(got, want) and got.dtype == want.dtype and got[0] >= 2


@pytest.mark.parametrize("why", ["gpu", "opt-out"])
def test_gpu_engines_and_the_opt_out_keep_vllms_helper(vllms_helper, monkeypatch, why):
    if why == "gpu":
        monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    else:
        monkeypatch.setenv(EAGER_RANKS_ENV, "0")
    assert not worker_ext.eager_token_ranks_on_cpu()
    assert sampler.batched_count_greater_than is ops.batched_count_greater_than

"""Two ranks on gloo: TP2 (with and without sequence parallelism; MoE needs it), DP2, PP2 and
EP2 (qwen3_moe). Each layout is one torchrun launch running several checks; every check
compares against HF transformers computed on each rank."""

import pytest
from trainer_harness import (
    assert_adam,
    assert_export,
    assert_grads,
    assert_parity,
    assert_rope,
    assert_shared_prefix,
    run_worker,
)

TP_ROPE = ["tiny-qwen3-yarn", "tiny-llama3-ctx64"]
TP_MODELS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe+sp", "tiny-llama+sp", *TP_ROPE]
# tied (embedding grads all-reduced across stages), untied with biases, llama3 RoPE re-derived on both stages
PP_MODELS = ["tiny-llama", "tiny-qwen2", "tiny-llama3-ctx64"]
DP_MODELS = ["tiny-llama", "tiny-qwen3"]


@pytest.fixture(scope="module")
def tp2():
    return run_worker(
        2, tp=2, checks=["parity", "export", "grads", "adam@tiny-qwen3", "adam@tiny-qwen3-moe+sp",
                         "shared_prefix@tiny-qwen3|tiny-llama+sp",
                         "rope@" + "|".join(TP_ROPE)], models=TP_MODELS
    )


@pytest.fixture(scope="module")
def dp2():
    return run_worker(2, checks=["grads", "adam"], models=DP_MODELS)


@pytest.fixture(scope="module")
def pp2():
    return run_worker(2, pp=2, checks=["parity", "export", "grads", "adam", "rope@tiny-llama3-ctx64",
                                       "shared_prefix@tiny-llama"], models=PP_MODELS)


@pytest.fixture(scope="module")
def ep2():
    return run_worker(2, ep=2, checks=["parity", "export", "grads", "adam"], models=["tiny-qwen3-moe"])


@pytest.mark.parametrize("model", TP_MODELS)
def test_tp2(tp2, model):
    assert [r["ranks"]["tp_size"] for r in tp2] == [2, 2]
    assert_parity(tp2, model)
    assert_export(tp2, model)
    assert_grads(tp2, model)


@pytest.mark.parametrize("model", TP_ROPE)
def test_tp2_rope_scaling_at_long_positions(tp2, model):
    assert_rope(tp2, model)


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama+sp"])
def test_tp2_shared_prefix_packing(tp2, model):
    assert_shared_prefix(tp2, model)


def test_pp2_shared_prefix_packing(pp2):
    assert_shared_prefix(pp2, "tiny-llama")


def test_pp2_rope_scaling_at_long_positions(pp2):
    assert_rope(pp2, "tiny-llama3-ctx64")


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe+sp"])
def test_tp2_optimizer(tp2, model):
    # also checks the grad norm under TP (clipping is active): sharded weights counted once per shard
    assert_adam(tp2, model)


@pytest.mark.parametrize("model", DP_MODELS)
def test_dp2_grads_are_summed_not_averaged(dp2, model):
    assert [r["ranks"]["dp"] for r in dp2] == [0, 1]
    assert_grads(dp2, model)
    assert_adam(dp2, model)


@pytest.mark.parametrize("model", PP_MODELS)
def test_pp2(pp2, model):
    assert [r["ranks"]["pp"] for r in pp2] == [0, 1]
    assert_parity(pp2, model)
    assert_export(pp2, model)
    assert_grads(pp2, model)
    assert_adam(pp2, model)


def test_ep2_qwen3_moe(ep2):
    assert [r["ranks"]["ep"] for r in ep2] == [0, 1]
    model = "tiny-qwen3-moe"
    assert_parity(ep2, model)
    assert_export(ep2, model)
    assert_grads(ep2, model)
    assert_adam(ep2, model)


@pytest.fixture(scope="module")
def four_layer_llama(tmp_path_factory):
    import torch
    import transformers

    from mlrl.modelzoo import hf_config_dict

    out = tmp_path_factory.mktemp("tiny-llama-4l")
    config = transformers.AutoConfig.for_model(**dict(hf_config_dict("builtin:tiny-llama"), num_hidden_layers=4))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return str(out)


def test_pp2_uneven_layer_split(four_layer_llama):
    from trainer_harness import WORKER, run_torchrun

    ranks, _ = run_torchrun(WORKER, ["--models", four_layer_llama, "--checks", "parity,export,grads", "--pp", "2",
                                     "--pp-split", "3,1"], 2)
    assert_parity(ranks, four_layer_llama)
    assert_export(ranks, four_layer_llama)
    assert_grads(ranks, four_layer_llama)
    # the first stage yields embedding + layers 0-2, the last layer 3 + final norm
    first = ranks[0][f"{four_layer_llama}/export"]["names"]
    assert "model.layers.2.mlp.down_proj.weight" in first and not any("layers.3." in n for n in first)


def test_tp2_triton_logprob_kernels_under_the_interpreter(monkeypatch):
    """The GPU logprob pass (mlrl.trainer.rank.logprob_kernels: Triton kernels plus the TP
    combination of per-rank row statistics) on CPU ranks through Triton's interpreter: TP2 over a
    72-token vocabulary padded to two slices of unequal valid width, parity and gradients vs HF."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ranks = run_worker(2, tp=2, checks=["parity", "grads"], models=["tiny-llama"])
    assert [r["logprob_kernels"] for r in ranks] == [True, True]  # the kernels really ran
    assert_parity(ranks, "tiny-llama")
    assert_grads(ranks, "tiny-llama")

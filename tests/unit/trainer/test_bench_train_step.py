"""tools/bench_train_step.py's pure pieces, without torchrun: the MFU parameter count agrees with
the Linear weights of real transformers models, the FLOPs formula, the public shape table (valid
transformers and mlrl-bridge configs), the random-weight folder, and argument validation (refused
before any work)."""

import json

import pytest
import torch
from helpers.tools import load_tool
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from mlrl.bridge import HFCheckpoint, spec_for

bench = load_tool("bench_train_step")

# name -> (config class, hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied, rope_theta)
PUBLIC = {
    "llama3.2-1b": (LlamaConfig, 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0),
    "qwen3-1.7b": (Qwen3Config, 2048, 28, 16, 8, 128, 6144, 151936, True, 1e6),
    "qwen3-8b": (Qwen3Config, 4096, 36, 32, 8, 128, 12288, 151936, False, 1e6),
}


def _linear_weights(cfg) -> int:
    """Elements of every distinct nn.Linear weight of the transformers model (meta device: no memory)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    weights = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return sum(weights.values())


@pytest.mark.parametrize("tied", [True, False])
def test_matmul_params_are_the_linear_weights_of_a_tiny_llama(tied):
    cfg = bench.shape_config("tiny")
    cfg.tie_word_embeddings = tied
    # the lm_head once, tied or not; the embedding lookup and the norms not at all
    assert bench.matmul_params(cfg) == _linear_weights(cfg) == 2 * (3 * 128 * 128 + 3 * 128 * 256) + 256 * 128


def test_matmul_params_skip_qwen3_qk_norms():
    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      intermediate_size=96, vocab_size=100, tie_word_embeddings=True)
    assert bench.matmul_params(cfg) == _linear_weights(cfg)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_shapes_are_valid_transformers_and_mlrl_configs(name):
    cls, hidden, layers, heads, kv, head_dim, inter, vocab, tied, theta = PUBLIC[name]
    cfg = bench.shape_config(name)
    assert type(cfg) is cls
    got = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
           cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings, cfg.rope_parameters["rope_theta"])
    assert got == (hidden, layers, heads, kv, head_dim, inter, vocab, tied, theta)
    if name == "llama3.2-1b":
        assert {k: cfg.rope_parameters[k] for k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                                                     "original_max_position_embeddings")} == \
            {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
    spec_for(json.loads(cfg.to_json_string()))  # mlrl's bridge takes the config.json it would write
    assert bench.matmul_params(cfg) == _linear_weights(cfg)


def test_flops_and_mfu_formula():
    cfg = bench.shape_config("tiny")  # 2 layers, 4 heads of 32
    P, seq = bench.matmul_params(cfg), 128
    attention = 6 * 2 * 2 * 4 * 32 * seq / 2  # fwd+bwd 3x, 2 FLOPs per MAC, QK^T and AV, causal half
    assert bench.train_flops_per_token(cfg, seq) == 6 * P + attention
    assert bench.forward_flops_per_token(cfg, seq) == pytest.approx(2 * P + attention / 3)
    assert bench.mfu(1e6, 4e5, 989.0) == pytest.approx(1e6 * 4e5 / 989e12)
    assert bench.mfu(1e6, 4e5, 989.0, gpus=2) == pytest.approx(bench.mfu(1e6, 4e5, 989.0) / 2)
    # Qwen3-1.7B at 2048 tokens per sample, 20k tok/s on one GPU:
    # (6 * 1.72e9 + 6 * 28 * 16 * 128 * 2048) * 2e4 / 989e12 = 22.3% of 989 TFLOP/s
    q = bench.shape_config("qwen3-1.7b")
    assert bench.matmul_params(q) == 1_720_451_072
    assert bench.mfu(bench.train_flops_per_token(q, 2048), 2e4, 989.0) == pytest.approx(0.2230, abs=1e-4)


def test_random_hf_dir_loads_in_transformers_and_the_bridge(tmp_path):
    out = bench.write_random_hf_dir("tiny", tmp_path / "tiny")
    hf = json.loads((out / "config.json").read_text())
    spec, arch = spec_for(hf)
    HFCheckpoint(out).check(spec, arch)  # every tensor the bridge expects, tied lm_head absent
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    sd = model.state_dict()
    assert hf["dtype"] == "bfloat16" and model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(sd["model.norm.weight"], torch.ones(128))
    w = sd["model.layers.1.mlp.down_proj.weight"]
    assert torch.isfinite(w).all() and 0.015 < float(w.std()) < 0.025


def test_unknown_model_shape_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        bench._parse(["--model-shape", "gpt-5"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--model-shape" in err and "'gpt-5'" in err
    assert all(n in err for n in ("llama3.2-1b", "qwen3-1.7b", "qwen3-8b")), err


def test_device_cuda_without_cuda_fails_before_any_work(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_work(*a, **k):
        raise AssertionError("work started despite --device cuda without CUDA")

    monkeypatch.setattr(bench, "write_random_hf_dir", no_work)
    monkeypatch.setattr(bench, "launch", no_work)
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cuda", "--model-shape", "qwen3-1.7b"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--device cuda" in err and "torch.cuda.is_available() is False" in err, err


def test_defaults_follow_the_device(monkeypatch):
    cpu = bench._parse([])
    assert (cpu.hf_dir, cpu.sample_len, cpu.micro_batches, cpu.steps, cpu.warmup) == \
        ("builtin:smollm2-135m-instruct", 128, 2, 3, 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu = bench._parse(["--device", "cuda", "--model-shape", "qwen3-1.7b", "--seq", "1024"])
    assert (gpu.model_shape, gpu.sample_len, gpu.micro_batches, gpu.steps, gpu.warmup) == ("qwen3-1.7b", 1024, 4, 5, 2)
    with pytest.raises(SystemExit):
        bench._parse(["--device", "cuda", "--tp", "2"])  # two processes, one GPU


def test_micro_batches_hold_whole_samples_as_the_trainer_packs_them():
    per = bench.samples_per_micro_batch
    assert per(16, 2048, budget=8192) == 4
    assert per(16, 2048, budget=14592) == 7  # 7 / 7 / 2, as first-fit packing fills them (not chunk's 6 / 5 / 5)
    assert per(16, 2048, budget=10**9) == 16
    assert per(16, 2048, micro_batches=4) == 4 and per(16, 2048, micro_batches=3) == 6  # torch.chunk's sizes
    assert [len(c) for c in torch.arange(16).split(per(16, 2048, micro_batches=3))] == \
        [len(c) for c in torch.arange(16).chunk(3)]


def _gpu_args(monkeypatch, *extra, capability=(9, 0)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    return bench._parse(["--device", "cuda", "--model-shape", "qwen3-1.7b", *extra])


def _shape_dir(tmp_path):
    bench.shape_config("qwen3-1.7b").save_pretrained(tmp_path)  # config.json alone: planning reads no weights
    return tmp_path


def test_auto_micro_batch_tokens_follow_the_gpu_memory_and_recompute(monkeypatch, tmp_path):
    """--micro-batch-tokens auto is mlrl's planner for this GPU: more memory or full recompute
    gives larger micro-batches, and the estimate of what it picked stays within the planner's 85%."""
    hf = _shape_dir(tmp_path)
    picked = {}
    for gb, recompute in [(80.0, "none"), (139.8, "none"), (80.0, "full")]:
        args = _gpu_args(monkeypatch, "--micro-batch-tokens", "auto", "--samples", "64", "--recompute", recompute)
        assert args.micro_batches is None  # derived from the budget, not the cuda default 4
        got = bench.resolve_micro_batches(args, hf, gb)
        assert got["micro_batch_tokens_auto"] and got["micro_batch_tokens"] % 256 == 0
        per = got["micro_batch_tokens"] // 2048
        assert per >= 1 and args.per_micro_batch == per and args.micro_batches == -(-64 // per)
        # planned for the largest micro-batch the bench runs, whole samples: at most the budget
        assert got["largest_micro_batch_tokens"] == per * 2048 <= got["micro_batch_tokens"]
        assert 0 < got["planned_train_gb"] <= 0.85 * gb * 2**30 / 1e9
        picked[gb, recompute] = got["micro_batch_tokens"]
    assert picked[139.8, "none"] > picked[80.0, "none"]
    assert picked[80.0, "full"] > picked[80.0, "none"]


def test_given_micro_batches_or_tokens_are_planned_as_given(monkeypatch, tmp_path):
    hf = _shape_dir(tmp_path)
    four = _gpu_args(monkeypatch)  # the cuda default: 4 micro-batches of 4 x 2048 tokens
    got4 = bench.resolve_micro_batches(four, hf, 139.8)
    assert four.micro_batches == 4 and got4["micro_batch_tokens"] == 8192 and not got4["micro_batch_tokens_auto"]
    assert four.per_micro_batch == 4 and got4["largest_micro_batch_tokens"] == 8192
    two = _gpu_args(monkeypatch, "--micro-batch-tokens", "16384")
    got2 = bench.resolve_micro_batches(two, hf, 139.8)
    assert two.micro_batches == 2 and got2["planned_train_gb"] > got4["planned_train_gb"]  # more activations


def test_auto_on_cpu_is_the_cpu_budget(tmp_path):
    args = bench._parse(["--hf-dir", "builtin:tiny-llama", "--samples", "4", "--sample-len", "16",
                         "--micro-batch-tokens", "auto"])
    got = bench.resolve_micro_batches(args, _shape_dir(tmp_path), None)
    assert got == {"micro_batch_tokens": 4096, "micro_batch_tokens_auto": True, "largest_micro_batch_tokens": 64,
                   "planned_train_gb": None}
    assert args.micro_batches == 1 and args.per_micro_batch == 4


@pytest.mark.parametrize("argv, says", [
    (["--micro-batch-tokens", "lots"], "--micro-batch-tokens: expected a positive integer or auto, got 'lots'"),
    (["--micro-batch-tokens", "0"], "--micro-batch-tokens: expected a positive integer or auto, got '0'"),
    (["--micro-batch-tokens", "\u00b2"], "--micro-batch-tokens: expected a positive integer or auto, got"),
    (["--micro-batch-tokens", "100"], "--micro-batch-tokens 100: a micro-batch holds whole samples, at least "
                                      "--sample-len (128) tokens"),
    (["--samples", "0"], "--samples: expected a positive integer, got 0"),
    (["--micro-batches", "3", "--micro-batch-tokens", "auto"], "not allowed with argument"),
    (["--micro-batches", "17"], "--micro-batches: expected 1..--samples (16), got 17"),
    (["--fp8-recipe", "tensorwise"], "--fp8-recipe tensorwise: FP8 runs through Transformer Engine on a GPU"),
    (["--recompute", "most"], "--recompute: invalid choice: 'most'"),
])
def test_bad_sizing_and_fp8_flags_are_refused_before_any_work(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench._parse(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err, err


def test_fp8_side_uses_the_recipe_and_keeps_the_bf16_plan(monkeypatch, tmp_path):
    args = _gpu_args(monkeypatch, "--fp8-recipe", "delayed")
    assert bench.bench_config(args, tmp_path).trainer.fp8_recipe == "none"
    fp8 = bench.bench_config(args, tmp_path, fp8_recipe=args.fp8_recipe)
    assert fp8.trainer.fp8_recipe == "delayed" and fp8.model.dtype == "bfloat16"


def test_mlrl_only_is_refused_on_cpu(capsys):
    with pytest.raises(SystemExit) as e:
        bench._parse(["--mlrl-only"])
    assert e.value.code == 2 and "--mlrl-only: the planner's estimate it reports is for GPUs" in capsys.readouterr().err


def test_cuda_report_with_and_without_hf_and_the_fp8_record(monkeypatch, capsys):
    """The GPU records from given timings (their arithmetic runs here; the timings need a GPU)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    args = _gpu_args(monkeypatch, "--fp8-recipe", "tensorwise")
    cfg = bench.shape_config("qwen3-1.7b")
    tokens = 16 * 2048
    only = bench._cuda_report(args, cfg, tokens, 1.0, 0.4, None, (50.0, 60.0), 1)
    assert "hf_train_tokens_per_s" not in only and only["mlrl_forward_over_train"] == pytest.approx(2.5)
    assert only["mlrl_train_mfu"] == pytest.approx(bench.train_flops_per_token(cfg, 2048) * tokens / 989e12)
    both = bench._cuda_report(args, cfg, tokens, 1.0, 0.4, (1.5, (70.0, 72.0), 0.5), (50.0, 60.0), 1)
    assert both["ratio_mlrl_over_hf"] == pytest.approx(1.5) and both["hf_peak_allocated_gb"] == 70.0
    fp8 = bench._fp8_report(args, cfg, tokens, 1.0, (0.8, None, (45.0, 50.0), 1.5), 1)
    assert fp8["ratio_fp8_over_bf16"] == pytest.approx(1.25) and fp8["fp8_recipe"] == "tensorwise"
    assert fp8["mlrl_fp8_start_allocated_gb"] == 1.5
    out = capsys.readouterr().out
    assert out.count("HF transformers") == 1 and "FP8 (tensorwise)" in out and "1.25x the bf16 step" in out


def test_fp8_recipes_this_gpu_cannot_run_are_refused_before_any_work(monkeypatch, capsys):
    """mxfp8 needs Blackwell (10.0): on a Hopper GPU it would fail only after the bf16 side ran."""
    with pytest.raises(SystemExit) as e:
        _gpu_args(monkeypatch, "--fp8-recipe", "mxfp8")
    assert e.value.code == 2 and "needs compute capability >= 10.0, this GPU has 9.0" in capsys.readouterr().err
    assert _gpu_args(monkeypatch, "--fp8-recipe", "blockwise").fp8_recipe == "blockwise"
    with pytest.raises(SystemExit):
        _gpu_args(monkeypatch, "--fp8-recipe", "tensorwise", capability=(8, 0))  # A100: no FP8


def test_few_samples_take_fewer_default_micro_batches(monkeypatch):
    assert _gpu_args(monkeypatch, "--samples", "2").micro_batches == 2  # the cuda default 4, capped by the samples

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

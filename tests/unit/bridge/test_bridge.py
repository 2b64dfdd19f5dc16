"""The bridge on CPU tensors: HF config parsing, name / shape maps, TP / PP / EP layout rules and
HF -> Megatron (sharded) -> HF round trips, bit-exact; checkpoint validation errors."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from mlrl.bridge import (
    BridgeError,
    HFCheckpoint,
    check_layout,
    global_name,
    padded_vocab_size,
    rank_experts,
    shard,
    spec_for,
    stage_layers,
    supported_model_types,
    unshard,
)
from mlrl.modelzoo import PRESETS, hf_config_dict

TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-llama3", "tiny-qwen3-yarn"]


def _hf(name):
    return hf_config_dict(f"builtin:{name}")


def _random_hf(spec, arch, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g) for n, shape in spec.hf_shapes(arch).items()}


def test_registry_lists_the_supported_types_and_rejects_others():
    assert supported_model_types() == ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]
    with pytest.raises(BridgeError, match=r"model_type 'gpt2' is not supported; supported: llama, mistral"):
        spec_for({"model_type": "gpt2"})


@pytest.mark.parametrize("name", TINY)
def test_every_megatron_param_maps_to_hf_and_back(name):
    spec, arch = spec_for(_hf(name))
    params = spec.params(arch)
    hf_names = [n for p in params for n in p.hf]
    assert len(hf_names) == len(set(hf_names)), "an HF tensor feeds two Megatron params"
    assert set(hf_names) == set(spec.hf_shapes(arch))
    assert len({p.name for p in params}) == len(params)
    # with PP > 1 and tied embeddings the last stage's output layer reads embed_tokens too
    tied_extra = {p.name for p in spec.params(arch, output_layer_when_tied=True)} - {p.name for p in params}
    assert tied_extra == ({"output_layer.weight"} if arch.tie_embeddings else set())


@pytest.mark.parametrize("name", TINY)
def test_hf_shapes_match_the_materialised_checkpoint(name):
    from mlrl.modelzoo import resolve_model_dir

    spec, arch = spec_for(_hf(name))
    ckpt = HFCheckpoint(resolve_model_dir(f"builtin:{name}"))
    ckpt.check(spec, arch)
    assert {n: i.shape for n, i in ckpt.tensors.items() if not spec.ignorable_hf_tensor(arch, n)} == spec.hf_shapes(
        arch
    )


def test_arch_fields():
    hf = _hf("tiny-llama")
    _, llama = spec_for(hf)
    assert (llama.tie_embeddings, llama.qkv_bias, llama.qk_norm) == (True, False, False)
    assert (llama.num_kv_heads, llama.head_dim, llama.hidden_size) == (
        hf["num_key_value_heads"],
        hf["head_dim"],
        hf["hidden_size"],
    )
    _, qwen2 = spec_for(_hf("tiny-qwen2"))
    assert qwen2.qkv_bias and not qwen2.tie_embeddings
    _, qwen3 = spec_for(_hf("tiny-qwen3"))
    assert qwen3.qk_norm and not qwen3.qkv_bias
    _, moe = spec_for(_hf("tiny-qwen3-moe"))
    hf = _hf("tiny-qwen3-moe")
    assert (moe.num_experts, moe.moe_topk, moe.moe_ffn_hidden_size, moe.moe_layers) == \
        (hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"], (True,) * hf["num_hidden_layers"])
    _, big = spec_for(PRESETS["Qwen/Qwen3-30B-A3B"])
    assert big.num_experts == 128 and big.rope_theta == 1e6


def test_fields_config_json_leaves_out_take_transformers_defaults():
    """transformers (and vLLM through it) fill an absent field with the config class's default: the
    bridge must read the same model, or trainer and engines differ with no shape to tell (qwen3_moe
    without norm_topk_prob: the trainer renormalised the top-k weights, transformers does not)."""
    import inspect

    from transformers import CONFIG_MAPPING

    from mlrl.bridge.arch import HF_CONFIG_DEFAULTS

    for mt in supported_model_types():
        sig = inspect.signature(CONFIG_MAPPING[mt].__init__).parameters
        assert HF_CONFIG_DEFAULTS[mt] == {k: sig[k].default for k in HF_CONFIG_DEFAULTS[mt]}, mt
        # the fields the bridge falls back on itself are either listed or None in transformers too
        for k in ("head_dim", "num_key_value_heads", "sliding_window", "norm_topk_prob", "tie_word_embeddings"):
            if k in sig and k not in HF_CONFIG_DEFAULTS[mt]:
                assert sig[k].default is None, (mt, k)

    def without(name, *keys):
        return {k: v for k, v in _hf(name).items() if k not in keys}

    _, moe = spec_for(without("tiny-qwen3-moe", "norm_topk_prob", "num_key_value_heads"))
    assert moe.norm_topk_prob is False and moe.num_kv_heads == 4
    _, qwen3 = spec_for(without("tiny-qwen3", "head_dim"))
    assert qwen3.head_dim == 128
    from mlrl.plan.model import model_shape  # the planner's memory estimates read the same model

    assert model_shape(without("tiny-qwen3", "head_dim"), "q").head_dim == 128
    assert model_shape(without("tiny-qwen3-moe", "num_key_value_heads"), "m").kv_heads == 4
    _, mistral = spec_for(dict(without("tiny-llama", "sliding_window"), model_type="mistral",
                               max_position_embeddings=8192))
    assert mistral.sliding_window == 4096
    # what config.json says wins
    _, explicit = spec_for(_hf("tiny-qwen3-moe"))
    assert explicit.norm_topk_prob is _hf("tiny-qwen3-moe")["norm_topk_prob"]


def test_transformer_config_fields():
    spec, moe = spec_for(_hf("tiny-qwen3-moe"))
    cfg = spec.transformer_config(moe)
    assert cfg["num_query_groups"] == moe.num_kv_heads and cfg["kv_channels"] == moe.head_dim and cfg["qk_layernorm"]
    assert cfg["num_moe_experts"] == moe.num_experts and cfg["moe_router_topk"] == moe.moe_topk
    assert cfg["moe_layer_freq"] == [1] * moe.num_layers
    assert cfg["moe_router_pre_softmax"] is False  # norm_topk_prob: softmax over the top-k logits
    kw = spec.gpt_model_kwargs(moe)
    assert kw["share_embeddings_and_output_weights"] is False and kw["rotary_base"] == 10000.0
    hf = dict(_hf("tiny-qwen3-moe"), norm_topk_prob=False, mlp_only_layers=[1])
    spec, moe2 = spec_for(hf)
    cfg = spec.transformer_config(moe2)
    assert cfg["moe_router_pre_softmax"] is True and cfg["moe_layer_freq"] == [1, 0]
    # a dense layer inside an MoE model maps to linear_fc1 / linear_fc2
    names = {p.name for p in spec.params(moe2)}
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names and "decoder.layers.1.mlp.router.weight" not in names


def test_unsupported_config_fields_are_named():
    with pytest.raises(BridgeError, match="hidden_act='gelu'"):
        spec_for(dict(_hf("tiny-llama"), hidden_act="gelu"))
    with pytest.raises(BridgeError, match="rope type 'dynamic'.*supported rope types: default, linear, llama3, yarn"):
        spec_for(dict(_hf("tiny-qwen3"), rope_scaling={"rope_type": "dynamic", "factor": 4.0}))
    with pytest.raises(BridgeError, match="missing field 'num_hidden_layers'"):
        spec_for({k: v for k, v in _hf("tiny-llama").items() if k != "num_hidden_layers"})
    with pytest.raises(BridgeError, match="attention_bias"):
        spec_for(dict(_hf("tiny-llama"), attention_bias=True))


def test_qkv_layout_is_megatrons_per_group_interleaving():
    spec, arch = spec_for(_hf("tiny-llama"))
    assert (arch.num_heads, arch.num_kv_heads) == (4, 2)
    p = next(p for p in spec.params(arch) if p.name.endswith("linear_qkv.weight"))
    hd, h = arch.head_dim, arch.hidden_size
    q = torch.arange(4 * hd * h, dtype=torch.float32).reshape(4 * hd, h)
    k = -torch.arange(2 * hd * h, dtype=torch.float32).reshape(2 * hd, h) - 1
    v = torch.full((2 * hd, h), 0.5) + torch.arange(2 * hd)[:, None]
    full = spec.to_megatron(arch, p, dict(zip(p.hf, (q, k, v))))
    # group g: q heads 2g, 2g+1, then k head g, then v head g
    per = 4 * hd
    for g in range(2):
        block = full[g * per:(g + 1) * per]
        assert torch.equal(block[: 2 * hd], q[2 * g * hd:(2 * g + 2) * hd])
        assert torch.equal(block[2 * hd:3 * hd], k[g * hd:(g + 1) * hd])
        assert torch.equal(block[3 * hd:], v[g * hd:(g + 1) * hd])
    # TP2: rank 1 holds exactly group 1
    assert torch.equal(shard(full, "column", 1, 2), full[per:])


def test_glu_sharding_keeps_gate_and_up_halves_per_rank():
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    full = torch.cat([gate, up])
    r1 = shard(full, "glu", 1, 2)
    assert torch.equal(r1, torch.cat([gate[4:], up[4:]]))
    assert torch.equal(unshard([shard(full, "glu", r, 2) for r in range(2)], "glu"), full)


def test_vocab_padding_and_rules_round_trip():
    assert padded_vocab_size(72, 1) == 128 and padded_vocab_size(72, 2) == 256 and padded_vocab_size(49152, 3) == 49152
    emb = torch.randn(72, 8)
    parts = [shard(emb, "vocab", r, 2, padded_rows=256) for r in range(2)]
    assert parts[0].shape == (128, 8) and torch.equal(parts[0][:72], emb) and not parts[1].any()
    assert torch.equal(unshard(parts, "vocab", rows=72), emb)
    w = torch.randn(6, 4)
    for rule in ("column", "row", "replicated"):
        assert torch.equal(unshard([shard(w, rule, r, 2) for r in range(2)], rule), w)
    with pytest.raises(BridgeError, match="cannot be split 4 ways"):
        shard(torch.randn(6, 4), "column", 0, 4)


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_megatron_hf_round_trip_is_bit_exact(name, tp):
    spec, arch = spec_for(_hf(name))
    hf = _random_hf(spec, arch)
    padded = padded_vocab_size(arch.vocab_size, tp)
    back = {}
    for p in spec.params(arch):
        full = spec.to_megatron(arch, p, hf)
        assert tuple(full.shape) == p.shape, p.name
        shards = [shard(full, p.tp, r, tp, padded_rows=padded if p.tp == "vocab" else None) for r in range(tp)]
        back.update(spec.to_hf(arch, p, unshard(shards, p.tp, rows=arch.vocab_size)))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_pipeline_and_expert_layout():
    assert stage_layers(8, 2, 1) == [4, 5, 6, 7]
    assert stage_layers(8, 2, 0, vpp=2, vp_stage=1) == [4, 5]  # chunk 1 of stage 0 comes after stage 1's chunk 0
    assert stage_layers(8, 2, 1, vpp=2, vp_stage=0) == [2, 3]
    assert stage_layers(5, 2, 1, split=[3, 2]) == [3, 4]
    with pytest.raises(BridgeError, match="must divide num_hidden_layers=5"):
        stage_layers(5, 2, 0)
    assert rank_experts(8, 4, 3) == [6, 7]
    assert (
        global_name("module.decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight", [4, 5], expert_offset=2)
        == "decoder.layers.5.mlp.experts.local_experts.2.linear_fc2.weight"
    )
    assert global_name("decoder.layers.0.mlp.experts.linear_fc1.weight1", [3], expert_offset=4) == \
        "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"
    assert (
        global_name("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", [7])
        == "decoder.layers.7.input_layernorm.weight"
    )
    assert global_name("embedding.word_embeddings.weight", [0]) == "embedding.word_embeddings.weight"


def test_layout_checks_name_the_parallel_field():
    _, arch = spec_for(_hf("tiny-llama"))
    with pytest.raises(BridgeError, match=r"parallel.tp=3 must divide the model's num_attention_heads=4"):
        check_layout(arch, tp=3)
    with pytest.raises(BridgeError, match=r"parallel.tp=4 must divide the model's num_key_value_heads=2"):
        check_layout(arch, tp=4)
    with pytest.raises(BridgeError, match=r"parallel.pp\*vpp = 4 must divide num_hidden_layers=2"):
        check_layout(arch, pp=2, vpp=2)
    with pytest.raises(BridgeError, match="has no experts"):
        check_layout(arch, ep=2)
    _, moe = spec_for(_hf("tiny-qwen3-moe"))
    with pytest.raises(BridgeError, match=r"parallel.ep=3 must divide the model's num_experts=4"):
        check_layout(moe, ep=3)
    check_layout(moe, tp=2, ep=2, pp=2)


def _write(path, tensors):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def test_without_an_index_the_weights_are_model_safetensors_as_for_transformers(tmp_path):
    """Another *.safetensors beside model.safetensors (Mistral's consolidated.safetensors, an EMA
    copy) is not the model: transformers ignores it. Without model.safetensors, files that hold the
    same tensor are ambiguous."""
    spec, arch = spec_for(_hf("tiny-llama"))
    hf = _random_hf(spec, arch)
    (tmp_path / "config.json").write_text(json.dumps(_hf("tiny-llama")))
    _write(tmp_path / "model.safetensors", hf)
    _write(tmp_path / "model_ema.safetensors", {n: torch.zeros_like(t) for n, t in hf.items()})
    _write(tmp_path / "consolidated.safetensors", {"tok_embeddings.weight": torch.zeros(2)})
    ckpt = HFCheckpoint(tmp_path)
    ckpt.check(spec, arch)
    name = sorted(hf)[0]
    assert torch.equal(ckpt.read([name])[name], hf[name])
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.safetensors")
    (tmp_path / "consolidated.safetensors").unlink()
    with pytest.raises(BridgeError, match=r"is in both model_ema.safetensors and weights.safetensors"):
        HFCheckpoint(tmp_path)


def test_checkpoint_validation(tmp_path):
    spec, arch = spec_for(_hf("tiny-llama"))
    hf = _random_hf(spec, arch)
    (tmp_path / "config.json").write_text(json.dumps(_hf("tiny-llama")))
    with pytest.raises(BridgeError, match="no \\*.safetensors"):
        HFCheckpoint(tmp_path)
    names = sorted(hf)
    _write(tmp_path / "a.safetensors", {n: hf[n] for n in names[:10]})
    _write(tmp_path / "b.safetensors", {n: hf[n] for n in names[10:]})
    index = {"weight_map": {**{n: "a.safetensors" for n in names[:10]}, **{n: "b.safetensors" for n in names[10:]}}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = HFCheckpoint(tmp_path)
    ckpt.check(spec, arch)
    got = ckpt.read([names[0], names[-1]])
    assert torch.equal(got[names[0]], hf[names[0]]) and torch.equal(got[names[-1]], hf[names[-1]])
    # a shard listed in the index is missing
    (tmp_path / "b.safetensors").rename(tmp_path / "b.bak")
    with pytest.raises(BridgeError, match="b.safetensors: safetensors shard listed in the index is missing"):
        HFCheckpoint(tmp_path)
    # truncated
    data = (tmp_path / "b.bak").read_bytes()
    (tmp_path / "b.safetensors").write_bytes(data[:-100])
    with pytest.raises(BridgeError, match="b.safetensors: truncated safetensors file"):
        HFCheckpoint(tmp_path)
    (tmp_path / "b.safetensors").write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(BridgeError, match="truncated"):
        HFCheckpoint(tmp_path)
    (tmp_path / "b.safetensors").write_bytes(data)
    # shape inconsistent with config.json names the tensor
    bad = dict(arch.__dict__)
    bad["ffn_hidden_size"] = 2 * arch.ffn_hidden_size
    from mlrl.bridge import ModelArch

    f, h = arch.ffn_hidden_size, arch.hidden_size
    with pytest.raises(
        BridgeError,
        match=rf"a.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape \[{f}, {h}\], "
        rf"config.json implies \[{2 * f}, {h}\]",
    ):
        ckpt = HFCheckpoint(tmp_path)
        ckpt.check(spec, ModelArch(**bad))

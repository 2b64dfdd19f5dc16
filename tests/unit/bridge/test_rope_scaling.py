"""RoPE scaling in the bridge: parsing of both transformers spellings (4.x `rope_scaling` +
`rope_theta`, 5.x `rope_parameters`), the Megatron-Core mapping of each supported type, and the
errors for unsupported types and missing fields. The numerics (Megatron vs HF logits) are checked
by the trainer parity tests on the builtin tiny-llama3 / tiny-llama3-ctx64 / tiny-qwen3-yarn."""

import math

import pytest

from mlrl.bridge import BridgeError, spec_for
from mlrl.bridge.arch import ROPE_TYPES, RopeScaling
from mlrl.modelzoo import hf_config_dict


def _hf(name, **kw):
    cfg = {k: v for k, v in hf_config_dict(f"builtin:{name}").items() if k not in ("rope_scaling", "rope_parameters")}
    return dict(cfg, **kw)


def test_plain_rope_has_no_scaling_in_either_spelling():
    _, a = spec_for(_hf("tiny-llama"))
    assert a.rope_scaling is None and a.rope_theta == 10000.0
    _, b = spec_for(_hf("tiny-llama", rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert b.rope_scaling is None and b.rope_theta == 5e5


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
def test_llama3_parses_and_maps_to_megatrons_rope_scaling(spelling):
    params = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    if spelling == "rope_parameters":
        hf = _hf("tiny-llama", rope_parameters=dict(params, rope_theta=5e5))
    else:
        hf = _hf("tiny-llama", rope_scaling=params, rope_theta=5e5)
    spec, arch = spec_for(hf)
    assert arch.rope_theta == 5e5
    assert arch.rope_scaling == RopeScaling("llama3", 32.0, original_max_position_embeddings=8192)
    kw = spec.gpt_model_kwargs(arch)
    assert kw["rope_scaling"] is True and kw["rope_scaling_factor"] == 32.0 and kw["position_embedding_type"] == "rope"
    # Megatron's constructor hard-codes 1 / 4 / 8192: nothing to re-derive
    assert spec.llama3_inv_freq_args(arch) is None and spec.config_attributes(arch) == {}


def test_llama3_with_other_band_parameters_is_re_derived_by_the_trainer():
    spec, arch = spec_for(hf_config_dict("builtin:tiny-llama3-ctx64"))
    assert spec.llama3_inv_freq_args(arch) == dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                   original_max_position_embeddings=64)


def test_linear_maps_to_position_interpolation():
    spec, arch = spec_for(_hf("tiny-qwen2", rope_scaling={"type": "linear", "factor": 2.0}))
    assert arch.rope_scaling.type == "linear"
    assert spec.gpt_model_kwargs(arch)["seq_len_interpolation_factor"] == 2.0


def test_yarn_maps_to_megatrons_yarn_with_transformers_defaults():
    spec, arch = spec_for(hf_config_dict("builtin:tiny-qwen3-yarn"))
    rs = arch.rope_scaling
    assert (rs.type, rs.factor, rs.original_max_position_embeddings, rs.beta_fast, rs.beta_slow, rs.truncate) == (
        "yarn", 4.0, 64, 32.0, 1.0, True)
    assert spec.gpt_model_kwargs(arch)["position_embedding_type"] == "yarn"
    attrs = spec.config_attributes(arch)
    assert attrs["yarn_rotary_scaling_factor"] == 4.0 and attrs["yarn_original_max_position_embeddings"] == 64
    # factor only -> attention factor 0.1 ln(4) + 1 (transformers and Megatron both), mscale inputs unset
    assert attrs["yarn_mscale"] is None and attrs["yarn_mscale_all_dim"] is None
    assert rs.yarn_attention_factor() == pytest.approx(0.1 * math.log(4.0) + 1.0)
    # without a factor, transformers derives it from max / original positions
    _, b = spec_for(_hf("tiny-qwen3", rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 128}))
    assert b.rope_scaling.factor == 2.0


def test_yarn_mscale_pair_and_attention_factor():
    hf = _hf("tiny-qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                         "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16, "truncate": False})
    spec, arch = spec_for(hf)
    attrs = spec.config_attributes(arch)
    assert attrs["yarn_mscale"] == 0.707 and attrs["yarn_beta_fast"] == 16.0
    assert attrs["yarn_correction_range_round_to_int"] is False
    assert arch.rope_scaling.yarn_attention_factor() == 1.0
    # an explicit attention_factor equal to the implied one is accepted; another is named
    ok = _hf("tiny-qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                         "attention_factor": 0.1 * math.log(4.0) + 1.0})
    spec_for(ok)
    bad = _hf("tiny-qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                          "attention_factor": 1.5})
    with pytest.raises(BridgeError, match="yarn attention_factor=1.5"):
        spec_for(bad)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su"])
def test_unsupported_rope_types_name_the_supported_ones(rope_type):
    expected = f"rope type '{rope_type}'.*supported rope types: default, linear, llama3, yarn"
    with pytest.raises(BridgeError, match=expected):
        spec_for(_hf("tiny-llama", rope_scaling={"rope_type": rope_type, "factor": 2.0}))
    assert ROPE_TYPES == ("default", "linear", "llama3", "yarn")


def test_missing_scaling_fields_are_named():
    with pytest.raises(BridgeError, match="rope type 'llama3' needs field 'low_freq_factor'"):
        spec_for(_hf("tiny-llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 8192}))
    with pytest.raises(BridgeError, match="rope type 'linear' needs field 'factor'"):
        spec_for(_hf("tiny-llama", rope_scaling={"rope_type": "linear"}))
    with pytest.raises(BridgeError, match="partial_rotary_factor=0.5"):
        spec_for(_hf("tiny-llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                                    "partial_rotary_factor": 0.5}))

"""`ModelArch`: the architecture facts mlrl needs, read once from a Hugging Face config.json.

Every later decision (Megatron config, tensor names and shapes, sharding) derives from this one
object, so the HF config is parsed in exactly one place and every missing or unsupported field
fails here with a one-line `BridgeError` naming the field and the model_type.

Transformers 4.x and 5.x spell a few fields differently (`rope_theta` + `rope_scaling` vs
`rope_parameters`, `num_experts` vs `num_local_experts`); both are accepted.

RoPE scaling (`RopeScaling`): the types Megatron-Core implements for GPT models are supported,
each mapped onto Megatron's own implementation by mlrl.bridge.specs / the trainer:
- `linear`  -> RotaryEmbedding(seq_len_interpolation_factor=factor) (positions / factor);
- `llama3`  -> RotaryEmbedding._apply_scaling(factor, low/high_freq_factor, original max positions);
- `yarn`    -> position_embedding_type="yarn" (YarnRotaryEmbedding; the attention factor is applied
               to q and k by Megatron's attention from the config's yarn_* fields).
`dynamic` (NTK re-scaled at run time by sequence length), `longrope` and the rest have no
Megatron-Core GPT implementation and are rejected by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SCORE_WEIGHT = "score.weight"  # transformers' *ForSequenceClassification head: [num_labels, hidden]


def is_sequence_classifier(hf: dict[str, Any]) -> bool:
    """config.json describes a `*ForSequenceClassification` (a reward model: a score head, no LM head)."""
    return any(str(a).endswith("ForSequenceClassification") for a in hf.get("architectures") or [])


class BridgeError(ValueError):
    """The HF config, the weights or the parallel layout cannot be mapped onto Megatron-Core."""


# What transformers (and vLLM, which reads the config through it) takes for a field config.json
# leaves out: the defaults of each config class's __init__ (transformers 5.19), for the fields the
# bridge reads whose own fallback would differ (e.g. qwen3_moe's norm_topk_prob is False, Qwen3's
# head_dim 128, Mistral's sliding_window 4096). Written out rather than read from transformers,
# whose import (~2 s, torch included) config validation avoids; tests/unit/bridge compares it with
# the installed classes.
HF_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-06,
              "tie_word_embeddings": False},
    "mistral": {"num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 32, "hidden_act": "silu", "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "sliding_window": 4096},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "sliding_window": 4096},
    "qwen3_moe": {"num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32768,
                  "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "sliding_window": 4096,
                  "decoder_sparse_step": 1, "norm_topk_prob": False},
}


def with_hf_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json with the fields it leaves out filled as transformers fills them."""
    return {**HF_CONFIG_DEFAULTS.get(str(hf.get("model_type")), {}), **hf}


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int            # dense MLP width (intermediate_size)
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_embeddings: bool
    qkv_bias: bool = False          # qwen2: biases on q/k/v (not on o_proj)
    qk_norm: bool = False           # qwen3: RMSNorm over each head of q and k
    num_experts: int = 0            # 0 = dense model
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_layers: tuple[bool, ...] = ()  # per layer: True = MoE MLP, False = dense MLP
    norm_topk_prob: bool = True     # renormalise the top-k routing weights (qwen3_moe)
    sliding_window: Optional[int] = None  # mistral: attention window (None = full causal)
    rope_scaling: Optional["RopeScaling"] = None  # None = plain RoPE (rope_type 'default')

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _get(hf: dict[str, Any], key: str, default: Any = ..., *, alt: tuple[str, ...] = ()) -> Any:
    for k in (key, *alt):
        if k in hf and hf[k] is not None:
            return hf[k]
    if default is ...:
        raise BridgeError(f"config.json: missing field {key!r} (model_type={hf.get('model_type')!r})")
    return default


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling of one of the supported types (HF semantics; defaults as transformers')."""

    type: str                                     # "linear" | "llama3" | "yarn"
    factor: float
    original_max_position_embeddings: Optional[int] = None  # llama3, yarn
    low_freq_factor: float = 1.0                  # llama3
    high_freq_factor: float = 4.0                 # llama3
    beta_fast: float = 32.0                       # yarn
    beta_slow: float = 1.0                        # yarn
    mscale: Optional[float] = None                # yarn (DeepSeek-style attention factor inputs)
    mscale_all_dim: Optional[float] = None        # yarn
    truncate: bool = True                         # yarn: round the correction range to integers

    def yarn_attention_factor(self) -> float:
        """The factor HF multiplies cos/sin by (transformers' `_compute_yarn_parameters`)."""

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim)
        return get_mscale(self.factor)


def _rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters in one dict: transformers 5 `rope_parameters` (theta inside), or
    transformers 4 `rope_scaling` (+ top-level `rope_theta`)."""
    params = dict(hf.get("rope_parameters") or {})
    if "rope_type" not in params and "type" not in params:
        params.update(hf.get("rope_scaling") or {})
    return params


def rope_theta(hf: dict[str, Any]) -> float:
    params = _rope_params(hf)
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise BridgeError(f"config.json: missing field 'rope_theta' (model_type={hf.get('model_type')!r})")
    return float(theta)


def rope_scaling(hf: dict[str, Any]) -> Optional[RopeScaling]:
    """The model's RoPE scaling (None for plain RoPE); an unsupported type or a missing field is a
    `BridgeError` naming it and the supported types."""
    params = _rope_params(hf)
    mt = hf.get("model_type")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise BridgeError(
            f"config.json: rope type {rope_type!r} (rope_scaling / rope_parameters) is not supported by mlrl's "
            f"bridge (model_type={mt!r}); supported rope types: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return None
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise BridgeError(f"config.json: partial_rotary_factor={params['partial_rotary_factor']} is not supported "
                          f"(model_type={mt!r}); expected 1.0")

    def need(key: str) -> Any:
        if params.get(key) is None:
            raise BridgeError(f"config.json: rope type {rope_type!r} needs field {key!r} in rope_scaling / "
                              f"rope_parameters (model_type={mt!r})")
        return params[key]

    if rope_type == "linear":
        return RopeScaling("linear", float(need("factor")))
    if rope_type == "llama3":
        return RopeScaling("llama3", float(need("factor")),
                           original_max_position_embeddings=int(need("original_max_position_embeddings")),
                           low_freq_factor=float(need("low_freq_factor")),
                           high_freq_factor=float(need("high_freq_factor")))
    # yarn: transformers' defaults (original max positions = max_position_embeddings, factor from
    # their ratio, beta_fast 32, beta_slow 1, truncate True)
    orig = int(params.get("original_max_position_embeddings") or _get(hf, "max_position_embeddings"))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else int(_get(hf, "max_position_embeddings")) / orig
    out = RopeScaling("yarn", factor, original_max_position_embeddings=orig,
                      beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                      mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
                      truncate=bool(params.get("truncate", True)))
    af = params.get("attention_factor")
    if af is not None and abs(float(af) - out.yarn_attention_factor()) > 1e-12:
        # Megatron derives the factor from (factor, mscale, mscale_all_dim); an explicit other
        # value has no Megatron-Core equivalent
        raise BridgeError(
            f"config.json: yarn attention_factor={af} differs from the one implied by factor / mscale / mscale_all_dim "
            f"({out.yarn_attention_factor()}); Megatron-Core's YaRN cannot represent it (model_type={mt!r})")
    return out


def parse_dense(hf: dict[str, Any], *, qkv_bias: bool, qk_norm: bool, tie_default: bool) -> dict[str, Any]:
    """Fields common to the llama / qwen decoder family."""
    act = _get(hf, "hidden_act", "silu")
    if act != "silu":
        raise BridgeError(
            f"config.json: hidden_act={act!r} is not supported (expected 'silu', model_type={hf.get('model_type')!r})"
        )
    heads = int(_get(hf, "num_attention_heads"))
    hidden = int(_get(hf, "hidden_size"))
    head_dim = int(_get(hf, "head_dim", hidden // heads))
    return dict(
        model_type=str(hf["model_type"]),
        vocab_size=int(_get(hf, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_get(hf, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(_get(hf, "num_key_value_heads", heads)),
        head_dim=head_dim,
        ffn_hidden_size=int(_get(hf, "intermediate_size")),
        norm_eps=float(_get(hf, "rms_norm_eps")),
        rope_theta=rope_theta(hf),
        rope_scaling=rope_scaling(hf),
        max_position_embeddings=int(_get(hf, "max_position_embeddings")),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", tie_default)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
    )

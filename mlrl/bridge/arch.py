"""`ModelArch`: the architecture facts mlrl needs, read once from a Hugging Face config.json.

Every later decision (Megatron config, tensor names and shapes, sharding) derives from this one
object, so the HF config is parsed in exactly one place and every missing or unsupported field
fails here with a one-line `BridgeError` naming the field and the model_type.

Transformers 4.x and 5.x spell a few fields differently (`rope_theta` vs `rope_parameters`,
`num_experts` vs `num_local_experts`); both are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


class BridgeError(ValueError):
    """The HF config, the weights or the parallel layout cannot be mapped onto Megatron-Core."""


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


def rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in ("default", None):
        raise BridgeError(
            f"config.json: rope type {rope_type!r} is not supported by mlrl's bridge (model_type="
            f"{hf.get('model_type')!r}); supported: plain RoPE (rope_type 'default')")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise BridgeError(f"config.json: missing field 'rope_theta' (model_type={hf.get('model_type')!r})")
    return float(theta)


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
        max_position_embeddings=int(_get(hf, "max_position_embeddings")),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", tie_default)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
    )

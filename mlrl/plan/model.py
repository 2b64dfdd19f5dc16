"""Parameter counts of a decoder-only transformer, read from its HF config.json only.

The planner must size Qwen3-8B / Qwen3-30B-A3B on a laptop, so nothing here touches weights.
Counts follow the HF module layout of the Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral families
(gated SiLU MLP, GQA attention, RMSNorm), which is also how Megatron-Core builds them:
- attention: q (h x a*d), k and v (h x g*d), o (a*d x h), biases on q/k/v when the family has
  them (Qwen2, `attention_bias`), per-head q/k RMSNorm in Qwen3 (2*d);
- dense MLP: gate, up (h x f) and down (f x h);
- MoE MLP: a router (h x E, replicated under TP in Megatron) and E experts of 3*h*f_e;
  layer i is MoE iff i is not in `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0
  (HF Qwen3-MoE's rule; Mixtral: every layer);
- two RMSNorms per layer, one final norm, the embedding (V x h) and the output layer
  (V x h unless `tie_word_embeddings`);
- LoRA adapters (model.lora, not part of the HF model): per adapted linear A [r, in] and B [out, r]
  (peft's shapes, mlrl.trainer.rank.lora), on dense-MLP layers only for gate/up/down.
Checked against the published totals: Qwen3-8B 8.19 B, Qwen3-30B-A3B 30.5 B (3.3 B active).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlrl.config.loader import ConfigError

_BIASED_QKV = {"qwen2", "qwen2_moe"}
_QK_NORM = {"qwen3", "qwen3_moe"}
# peft module -> the Megatron linear it adapts (q/k/v share the fused linear_qkv, gate/up linear_fc1)
LORA_LINEAR = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
               "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
LORA_ROW = frozenset({"o_proj", "down_proj"})  # on row-parallel linears: the input is split over TP
_LORA_MLP = frozenset({"gate_proj", "up_proj", "down_proj"})


class ModelShapeError(ConfigError):
    """The HF config lacks a field the planner needs."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes the planner needs, in elements (not bytes)."""

    name: str
    model_type: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int                   # dense MLP intermediate size
    experts: int               # 0 = dense model
    top_k: int
    expert_ffn: int
    shared_expert_ffn: int     # 0 = no shared expert
    moe_layer: tuple[bool, ...]  # per layer: MoE MLP (True) or dense MLP
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    max_positions: int | None

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.experts > 0 and any(self.moe_layer)

    # --- per-layer pieces -------------------------------------------------------------
    def attention_params(self) -> int:
        """Linear weights (+ q/k/v biases) of one attention block: all sharded by TP."""
        h, q, kv = self.hidden, self.q_width, self.kv_width
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return h * q + 2 * h * kv + q * h + bias

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.ffn

    def expert_params(self) -> int:
        """One routed expert (gate, up, down)."""
        return 3 * self.hidden * self.expert_ffn

    def shared_expert_params(self) -> int:
        return 3 * self.hidden * self.shared_expert_ffn

    def router_params(self) -> int:
        return self.hidden * self.experts

    def norm_params(self) -> int:
        """Replicated under TP: two RMSNorms, plus Qwen3's per-head q/k norms."""
        return 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def lora_dims(self, module: str) -> tuple[int, int]:
        """(in, out) features of the linear a peft module name adapts."""
        h, q, kv, f = self.hidden, self.q_width, self.kv_width, self.ffn
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}[module]

    def lora_layer_params(self, i: int, rank: int, targets: tuple[str, ...], *, tp: int = 1) -> int:
        """LoRA A and B of layer i on one of `tp` ranks: r * (in + out) per adapted linear, of which
        Megatron splits the parallel dimension (column-parallel q/k/v/gate/up: B's out; row-parallel
        o/down: A's in) and replicates the other matrix. MoE layers have no dense gate/up/down to
        adapt (validation allows attention targets only on MoE models)."""
        n = 0
        for m in self.lora_layer_targets(i, targets):
            d_in, d_out = self.lora_dims(m)
            n += rank * (d_in // tp + d_out if m in LORA_ROW else d_in + d_out // tp)
        return n

    def lora_layer_targets(self, i: int, targets: tuple[str, ...]) -> tuple[str, ...]:
        """The targets layer i has: no gate/up/down on a MoE layer."""
        return tuple(m for m in targets if not (self.moe_layer[i] and m in _LORA_MLP))

    # --- totals -----------------------------------------------------------------------
    def layer_params(self, i: int, *, active: bool = False) -> int:
        n = self.attention_params() + self.norm_params()
        if self.moe_layer[i]:
            k = self.top_k if active else self.experts
            n += self.router_params() + k * self.expert_params() + self.shared_expert_params()
        else:
            n += self.dense_mlp_params()
        return n

    def total_params(self, *, active: bool = False) -> int:
        body = sum(self.layer_params(i, active=active) for i in range(self.layers))
        heads = self.embedding_params() * (1 if self.tied else 2)
        return body + heads + self.hidden  # + final norm

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Every LoRA adapter of the model (what peft reports as trainable parameters)."""
        return sum(self.lora_layer_params(i, rank, targets) for i in range(self.layers))


def model_shape(hf: dict[str, Any], name: str) -> ModelShape:
    """Read the sizes from an HF config dict (the fields it leaves out as transformers fills them,
    mlrl.bridge.arch.with_hf_defaults); a one-line error names a missing field."""
    from mlrl.bridge.arch import with_hf_defaults

    hf = with_hf_defaults(hf)

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ModelShapeError(f"model {name}: config.json lacks {key!r} (needed by the dry-run planner)")
        return hf[key]

    model_type = str(hf.get("model_type", "unknown"))
    hidden, layers, heads = int(need("hidden_size")), int(need("num_hidden_layers")), int(need("num_attention_heads"))
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if experts:
        only_dense = set(hf.get("mlp_only_layers") or [])
        step = int(hf.get("decoder_sparse_step") or 1)
        moe = tuple(i not in only_dense and (i + 1) % step == 0 for i in range(layers))
    else:
        moe = (False,) * layers
    ffn = int(hf.get("intermediate_size") or 0)
    if not experts or not all(moe):
        ffn = int(need("intermediate_size"))
    return ModelShape(
        name=name,
        model_type=model_type,
        vocab=int(need("vocab_size")),
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        ffn=ffn,
        experts=experts,
        top_k=int(hf.get("num_experts_per_tok") or 0),
        expert_ffn=int(hf.get("moe_intermediate_size") or hf.get("intermediate_size") or 0) if experts else 0,
        shared_expert_ffn=int(hf.get("shared_expert_intermediate_size") or 0),
        moe_layer=moe,
        tied=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bool(hf.get("attention_bias", model_type in _BIASED_QKV)),
        qk_norm=model_type in _QK_NORM,
        max_positions=hf.get("max_position_embeddings"),
    )

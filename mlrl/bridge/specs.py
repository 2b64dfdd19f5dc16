"""Architecture specs, registered by Hugging Face `model_type`.

A spec knows, for one family of HF models:
- `parse(hf_config) -> ModelArch` (the facts),
- `transformer_config(arch)` / `gpt_model_kwargs(arch)`: the Megatron-Core TransformerConfig and
  GPTModel fields, as plain values (this package imports no megatron; the trainer instantiates),
- `params(arch)`: every Megatron parameter under its *global* name (layer and expert indices of
  the full model, Megatron-Core's local layer spec naming), with its full shape, the HF tensors
  it is made from and its TP rule,
- `to_megatron(p, hf_tensors)` / `to_hf(p, full)`: the tensor conversion (fused QKV with
  Megatron's per-query-group interleaving, fused gate/up into linear_fc1, plain copies).

Conversions are reshapes, concatenations and slices only, so HF -> Megatron -> HF is bit-exact.
Megatron's "full" tensor of a vocab-parallel weight is the unpadded one; padding is a sharding
concern (mlrl.bridge.sharding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from mlrl.bridge.arch import BridgeError, ModelArch, parse_dense, with_hf_defaults

if TYPE_CHECKING:  # config validation reads the specs without importing torch (~1.2 s, before the engines start)
    import torch

    from mlrl.bridge.sharding import TPRule


@dataclass(frozen=True)
class ParamSpec:
    name: str                      # global Megatron name, e.g. decoder.layers.3.self_attention.linear_qkv.weight
    shape: tuple[int, ...]         # full (TP-unsharded, vocab-unpadded) shape
    hf: tuple[str, ...]            # HF tensors it is built from, in conversion order
    tp: TPRule
    convert: str                   # "copy" | "qkv" | "glu"
    layer: Optional[int] = None    # global decoder layer (None: embedding / final norm / output layer)
    expert: Optional[int] = None   # global expert index (MoE expert weights only)
    stage: Optional[str] = None    # "first" (embedding), "last" (final norm / output layer), None (a layer)

    @property
    def is_expert(self) -> bool:
        return self.expert is not None


class ArchSpec:
    """The llama / mistral / qwen2 / qwen3 / qwen3_moe decoder family (pre-norm, RMSNorm, RoPE,
    SwiGLU). Subclasses only change how the HF config is read."""

    model_types: tuple[str, ...] = ()
    hf_architectures: dict[str, str] = {}  # model_type -> transformers class (tools/convert_checkpoint.py --list)

    def parse(self, hf: dict[str, Any]) -> ModelArch:
        raise NotImplementedError

    # ---- Megatron configuration --------------------------------------------------------------
    def transformer_config(self, arch: ModelArch) -> dict[str, Any]:
        """TransformerConfig fields that the HF config determines (activation given by name)."""
        cfg: dict[str, Any] = dict(
            num_layers=arch.num_layers,
            hidden_size=arch.hidden_size,
            num_attention_heads=arch.num_heads,
            num_query_groups=arch.num_kv_heads,
            kv_channels=arch.head_dim,
            ffn_hidden_size=arch.ffn_hidden_size,
            normalization="RMSNorm",
            layernorm_epsilon=arch.norm_eps,
            gated_linear_unit=True,
            activation_func="silu",
            add_bias_linear=False,
            add_qkv_bias=arch.qkv_bias,
            qk_layernorm=arch.qk_norm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            rotary_interleaved=False,
        )
        if arch.is_moe:
            cfg.update(
                num_moe_experts=arch.num_experts,
                moe_router_topk=arch.moe_topk,
                moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
                moe_layer_freq=[1 if m else 0 for m in arch.moe_layers],
                moe_router_score_function="softmax",
                # softmax over the top-k logits == renormalised top-k of the full softmax
                moe_router_pre_softmax=not arch.norm_topk_prob,
                moe_router_load_balancing_type="none",
                moe_aux_loss_coeff=0.0,
            )
        # arch.sliding_window is not mapped: the trainer rejects samples longer than the window,
        # for which windowed attention equals full causal attention.
        return cfg

    def gpt_model_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        """GPTModel constructor fields (vocab_size is the unpadded one; the trainer pads).
        RoPE scaling: linear -> seq_len_interpolation_factor; llama3 -> rope_scaling +
        rope_scaling_factor (Megatron fixes low/high_freq_factor 1/4 and 8192 original positions:
        `llama3_inv_freq_args` says when the trainer must re-derive inv_freq); yarn ->
        position_embedding_type "yarn" (parameters in `config_attributes`)."""
        kw: dict[str, Any] = dict(
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            share_embeddings_and_output_weights=arch.tie_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=arch.rope_theta,
        )
        rs = arch.rope_scaling
        if rs is not None and rs.type == "linear":
            kw["seq_len_interpolation_factor"] = rs.factor
        elif rs is not None and rs.type == "llama3":
            kw.update(rope_scaling=True, rope_scaling_factor=rs.factor)
        elif rs is not None and rs.type == "yarn":
            kw["position_embedding_type"] = "yarn"
        return kw

    # Megatron's RotaryEmbedding._apply_scaling defaults (what GPTModel(rope_scaling=True) uses)
    MEGATRON_LLAMA3_DEFAULTS = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

    def llama3_inv_freq_args(self, arch: ModelArch) -> Optional[dict[str, Any]]:
        """Arguments for `RotaryEmbedding._apply_scaling` when a llama3 scaling differs from the
        values GPTModel's constructor hard-codes (None: the constructor's scaling is the model's)."""
        rs = arch.rope_scaling
        if rs is None or rs.type != "llama3":
            return None
        args = dict(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                    original_max_position_embeddings=rs.original_max_position_embeddings)
        if args == self.MEGATRON_LLAMA3_DEFAULTS:
            return None
        return dict(args, factor=rs.factor)

    def config_attributes(self, arch: ModelArch) -> dict[str, Any]:
        """Attributes set on the built TransformerConfig that are not constructor fields of every
        supported megatron-core version: the `yarn_*` values GPTModel and Attention read with
        getattr (Attention multiplies q and k by the YaRN attention factor they imply)."""
        rs = arch.rope_scaling
        if rs is None or rs.type != "yarn":
            return {}
        if rs.mscale and rs.mscale_all_dim:  # transformers: both set, else factor only
            mscale, mscale_all_dim = float(rs.mscale), float(rs.mscale_all_dim)
        else:
            mscale = mscale_all_dim = None
        return dict(
            yarn_rotary_scaling_factor=rs.factor,
            yarn_original_max_position_embeddings=rs.original_max_position_embeddings,
            yarn_beta_fast=rs.beta_fast,
            yarn_beta_slow=rs.beta_slow,
            yarn_mscale=mscale,
            yarn_mscale_all_dim=mscale_all_dim,
            yarn_correction_range_round_to_int=rs.truncate,
        )

    # ---- tensor map ----------------------------------------------------------------------------
    def params(self, arch: ModelArch, *, output_layer_when_tied: bool = False) -> list[ParamSpec]:
        """Every Megatron parameter of the full model. With tied embeddings Megatron has no
        output layer at PP=1; at PP>1 the last stage holds a copy (`output_layer_when_tied`)."""
        h, v = arch.hidden_size, arch.vocab_size
        out = [
            ParamSpec(
                "embedding.word_embeddings.weight",
                (v, h),
                ("model.embed_tokens.weight",),
                "vocab",
                "copy",
                stage="first",
            )
        ]
        for i in range(arch.num_layers):
            out.extend(self._layer_params(arch, i))
        out.append(
            ParamSpec(
                "decoder.final_layernorm.weight", (h,), ("model.norm.weight",), "replicated", "copy", stage="last"
            )
        )
        if not arch.tie_embeddings:
            out.append(ParamSpec("output_layer.weight", (v, h), ("lm_head.weight",), "vocab", "copy", stage="last"))
        elif output_layer_when_tied:
            out.append(
                ParamSpec("output_layer.weight", (v, h), ("model.embed_tokens.weight",), "vocab", "copy", stage="last")
            )
        return out

    def _layer_params(self, arch: ModelArch, i: int) -> list[ParamSpec]:
        h, hd = arch.hidden_size, arch.head_dim
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv_rows = arch.q_size + 2 * arch.kv_size
        attn = (f"{p}self_attn.q_proj", f"{p}self_attn.k_proj", f"{p}self_attn.v_proj")
        out = [
            ParamSpec(
                m + "input_layernorm.weight", (h,), (p + "input_layernorm.weight",), "replicated", "copy", layer=i
            ),
            ParamSpec(
                m + "self_attention.linear_qkv.weight",
                (qkv_rows, h),
                tuple(a + ".weight" for a in attn),
                "column",
                "qkv",
                layer=i,
            ),
            ParamSpec(
                m + "self_attention.linear_proj.weight",
                (h, arch.q_size),
                (p + "self_attn.o_proj.weight",),
                "row",
                "copy",
                layer=i,
            ),
            ParamSpec(
                m + "pre_mlp_layernorm.weight",
                (h,),
                (p + "post_attention_layernorm.weight",),
                "replicated",
                "copy",
                layer=i,
            ),
        ]
        if arch.qkv_bias:
            out.append(
                ParamSpec(
                    m + "self_attention.linear_qkv.bias",
                    (qkv_rows,),
                    tuple(a + ".bias" for a in attn),
                    "column",
                    "qkv",
                    layer=i,
                )
            )
        if arch.qk_norm:
            out.append(
                ParamSpec(
                    m + "self_attention.q_layernorm.weight",
                    (hd,),
                    (p + "self_attn.q_norm.weight",),
                    "replicated",
                    "copy",
                    layer=i,
                )
            )
            out.append(
                ParamSpec(
                    m + "self_attention.k_layernorm.weight",
                    (hd,),
                    (p + "self_attn.k_norm.weight",),
                    "replicated",
                    "copy",
                    layer=i,
                )
            )
        if arch.is_moe and arch.moe_layers[i]:
            f = arch.moe_ffn_hidden_size
            out.append(
                ParamSpec(
                    m + "mlp.router.weight",
                    (arch.num_experts, h),
                    (p + "mlp.gate.weight",),
                    "replicated",
                    "copy",
                    layer=i,
                )
            )
            for e in range(arch.num_experts):
                me, pe = f"{m}mlp.experts.local_experts.{e}.", f"{p}mlp.experts.{e}."
                out.append(
                    ParamSpec(
                        me + "linear_fc1.weight",
                        (2 * f, h),
                        (pe + "gate_proj.weight", pe + "up_proj.weight"),
                        "glu",
                        "glu",
                        layer=i,
                        expert=e,
                    )
                )
                out.append(
                    ParamSpec(
                        me + "linear_fc2.weight", (h, f), (pe + "down_proj.weight",), "row", "copy", layer=i, expert=e
                    )
                )
        else:
            f = arch.ffn_hidden_size
            out.append(
                ParamSpec(
                    m + "mlp.linear_fc1.weight",
                    (2 * f, h),
                    (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    "glu",
                    "glu",
                    layer=i,
                )
            )
            out.append(
                ParamSpec(m + "mlp.linear_fc2.weight", (h, f), (p + "mlp.down_proj.weight",), "row", "copy", layer=i)
            )
        return out

    def hf_shapes(self, arch: ModelArch) -> dict[str, tuple[int, ...]]:
        """Every HF tensor the model must have, with its shape (what the checkpoint is checked against)."""
        shapes: dict[str, tuple[int, ...]] = {}
        for p in self.params(arch):
            for name, shape in zip(p.hf, self._hf_part_shapes(arch, p)):
                shapes[name] = shape
        return shapes

    def _hf_part_shapes(self, arch: ModelArch, p: ParamSpec) -> list[tuple[int, ...]]:
        if p.convert == "qkv":
            tail = p.shape[1:]
            return [(arch.q_size, *tail), (arch.kv_size, *tail), (arch.kv_size, *tail)]
        if p.convert == "glu":
            half = (p.shape[0] // 2, *p.shape[1:])
            return [half, half]
        return [p.shape]

    def to_megatron(self, arch: ModelArch, p: ParamSpec, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
        import torch

        parts = [hf[n] for n in p.hf]
        if p.convert == "copy":
            return parts[0]
        if p.convert == "glu":
            return torch.cat(parts, dim=0)
        if p.convert == "qkv":
            ng, hd = arch.num_kv_heads, arch.head_dim
            q, k, v = parts
            tail = q.shape[1:]
            q = q.reshape(ng, arch.num_heads // ng * hd, *tail)
            k = k.reshape(ng, hd, *tail)
            v = v.reshape(ng, hd, *tail)
            return torch.cat([q, k, v], dim=1).reshape(-1, *tail)
        raise BridgeError(f"unknown conversion {p.convert!r} for {p.name}")

    def to_hf(self, arch: ModelArch, p: ParamSpec, full: torch.Tensor) -> dict[str, torch.Tensor]:
        if p.convert == "copy":
            return {p.hf[0]: full}
        if p.convert == "glu":
            gate, up = full.chunk(2, dim=0)
            return {p.hf[0]: gate, p.hf[1]: up}
        if p.convert == "qkv":
            ng, hd = arch.num_kv_heads, arch.head_dim
            per_q = arch.num_heads // ng * hd
            tail = full.shape[1:]
            grouped = full.reshape(ng, per_q + 2 * hd, *tail)
            q, k, v = grouped.split([per_q, hd, hd], dim=1)
            return {p.hf[0]: q.reshape(-1, *tail), p.hf[1]: k.reshape(-1, *tail), p.hf[2]: v.reshape(-1, *tail)}
        raise BridgeError(f"unknown conversion {p.convert!r} for {p.name}")

    def ignorable_hf_tensor(self, arch: ModelArch, name: str) -> bool:
        """HF tensors that may be present but carry nothing Megatron needs."""
        return name.endswith("rotary_emb.inv_freq") or (arch.tie_embeddings and name == "lm_head.weight")


_REGISTRY: dict[str, ArchSpec] = {}


def register(*model_types: str) -> Callable[[type[ArchSpec]], type[ArchSpec]]:
    """Class decorator: register a spec for the given HF model_type values."""

    def deco(cls: type[ArchSpec]) -> type[ArchSpec]:
        cls.model_types = tuple(model_types)
        inst = cls()
        for t in model_types:
            if t in _REGISTRY:
                raise BridgeError(f"model_type {t!r} registered twice")
            _REGISTRY[t] = inst
        return cls

    return deco


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def get_spec(model_type: Optional[str]) -> ArchSpec:
    if model_type not in _REGISTRY:
        raise BridgeError(
            f"config.json: model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
        )
    return _REGISTRY[model_type]


def spec_for(hf: dict[str, Any]) -> tuple[ArchSpec, ModelArch]:
    """The spec registered for hf['model_type'] and the parsed architecture."""
    spec = get_spec(hf.get("model_type"))
    return spec, spec.parse(with_hf_defaults(hf))


@register("llama", "mistral")
class LlamaSpec(ArchSpec):
    hf_architectures = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}

    def parse(self, hf: dict[str, Any]) -> ModelArch:
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise BridgeError(
                f"config.json: attention_bias/mlp_bias=True is not supported for model_type={hf.get('model_type')!r}"
            )
        fields = parse_dense(hf, qkv_bias=False, qk_norm=False, tie_default=False)
        window = hf.get("sliding_window")
        if window is not None and int(window) < fields["max_position_embeddings"]:
            fields["sliding_window"] = int(window)
        return ModelArch(**fields)


@register("qwen2")
class Qwen2Spec(ArchSpec):
    hf_architectures = {"qwen2": "Qwen2ForCausalLM"}

    def parse(self, hf: dict[str, Any]) -> ModelArch:
        if hf.get("use_sliding_window"):
            raise BridgeError("config.json: use_sliding_window=True is not supported for model_type='qwen2'")
        return ModelArch(**parse_dense(hf, qkv_bias=True, qk_norm=False, tie_default=False))


@register("qwen3")
class Qwen3Spec(ArchSpec):
    hf_architectures = {"qwen3": "Qwen3ForCausalLM"}

    def parse(self, hf: dict[str, Any]) -> ModelArch:
        if hf.get("attention_bias"):
            raise BridgeError("config.json: attention_bias=True is not supported for model_type='qwen3'")
        if hf.get("use_sliding_window"):
            raise BridgeError("config.json: use_sliding_window=True is not supported for model_type='qwen3'")
        return ModelArch(**parse_dense(hf, qkv_bias=False, qk_norm=True, tie_default=False))


@register("qwen3_moe")
class Qwen3MoeSpec(ArchSpec):
    hf_architectures = {"qwen3_moe": "Qwen3MoeForCausalLM (MoE)"}

    def parse(self, hf: dict[str, Any]) -> ModelArch:
        if hf.get("attention_bias"):
            raise BridgeError("config.json: attention_bias=True is not supported for model_type='qwen3_moe'")
        fields = parse_dense(hf, qkv_bias=False, qk_norm=True, tie_default=False)
        experts = hf.get("num_experts") or hf.get("num_local_experts")
        if not experts:
            raise BridgeError("config.json: missing field 'num_experts' (model_type='qwen3_moe')")
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            if not hf.get(key):
                raise BridgeError(f"config.json: missing field {key!r} (model_type='qwen3_moe')")
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        dense_only = set(hf.get("mlp_only_layers") or [])
        n = fields["num_layers"]
        moe_layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(n))
        return ModelArch(**fields, num_experts=int(experts), moe_topk=int(hf["num_experts_per_tok"]),
                         moe_ffn_hidden_size=int(hf["moe_intermediate_size"]), moe_layers=moe_layers,
                         norm_topk_prob=bool(hf.get("norm_topk_prob", True)))

"""Building the sharded GPTModel: TransformerConfig from the bridge spec + config, layer spec by
device, one model chunk per virtual pipeline stage.

- CPU: Megatron-Core's local layer spec (no Transformer Engine), adapted in `local_spec`
  (packed THD attention; a sequence-parallel-aware norm); fusions off.
- GPU: the Transformer Engine layer spec (THD attention, grouped-GEMM experts, FP8 recipes,
  fused RoPE), recompute as configured.

FP8, context parallelism and the TE spec are GPU code paths (tests in tests/gpu/); on CPU the
config validation has already rejected them, and `build_transformer_config` re-checks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
import torch.nn.functional as F

from mlrl.bridge import ArchSpec, ModelArch, padded_vocab_size
from mlrl.config.schema import ModelConfig, ParallelConfig, TrainerConfig
from mlrl.config.validate import Layout
from mlrl.trainer.rank import cpu_compat, numerics

_ACTIVATIONS = {"silu": F.silu}
# model.dtype -> the trainer's params dtype (bf16 / fp16 train with fp32 master weights)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# mlrl's fp8_recipe -> (TransformerConfig.fp8 format, TransformerConfig.fp8_recipe)
_FP8 = {"tensorwise": ("hybrid", "tensorwise"), "delayed": ("hybrid", "delayed"),
        "blockwise": ("e4m3", "blockwise"), "mxfp8": ("e4m3", "mxfp8")}


def _no_init(tensor: torch.Tensor) -> torch.Tensor:
    """Parameter initialiser that leaves the tensor as allocated (weights are loaded next)."""
    return tensor


def use_te() -> bool:
    """The Transformer Engine spec is used exactly when CUDA is present."""
    return not cpu_compat.needed()


def params_dtype(model: ModelConfig) -> torch.dtype:
    """The trainer's parameter dtype: model.dtype (its precision, model.precision, follows it)."""
    return _DTYPES[model.dtype]


def layout_fields(arch: ModelArch, model: ModelConfig, parallel: ParallelConfig, trainer: TrainerConfig,
                  layout: Layout) -> dict[str, Any]:
    """The TransformerConfig fields mlrl sets about layout, precision, fusions and loss
    accounting (not about the architecture): the built-in path adds the bridge spec's
    architecture fields, the megatron-bridge path (mlrl.trainer.rank.mbridge) sets these on its
    provider, so the schedules, DDP and the loss contract see the same settings on both."""
    dtype = params_dtype(model)
    gpu = use_te()
    if not gpu and (trainer.fp8_recipe != "none" or layout.cp > 1):
        raise RuntimeError("trainer.fp8_recipe / parallel.cp > 1 need CUDA and Transformer Engine")
    fields: dict[str, Any] = dict(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp and layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # the loss arriving from mlrl is already normalised over the whole step: megatron must
        # neither divide by the number of micro-batches nor average over DP (see policy.py)
        calculate_per_token_loss=True,
        variable_seq_lengths=layout.pp > 1,  # pipeline p2p sends shapes first (micro-batches differ in length)
        use_cpu_initialization=not gpu,
        masked_softmax_fusion=False,
        bias_activation_fusion=gpu,
        bias_dropout_fusion=gpu,
        # TE's fused RoPE ignores YaRN's attention factor on packed (THD) inputs: unfused for yarn
        apply_rope_fusion=gpu and not (arch.rope_scaling is not None and arch.rope_scaling.type == "yarn"),
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        # alltoall for MoE; also required by TransformerConfig whenever variable_seq_lengths is set
        moe_token_dispatcher_type="alltoall",
    )
    if arch.is_moe:
        # no load-balancing loss, on either path (the built-in spec sets the same; a megatron-bridge
        # provider would take the HF config's aux-loss coefficient): megatron scales that loss by 1
        # per micro-batch under calculate_per_token_loss and DDP sums it over DP, so its weight
        # against mlrl's step-normalised loss would depend on the split
        fields.update(moe_grouped_gemm=gpu, moe_permute_fusion=False, moe_router_dtype="fp32",
                      moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    if trainer.recompute == "selective":
        fields.update(recompute_granularity="selective")
    elif trainer.recompute == "full":
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if trainer.fp8_recipe != "none":
        fmt, recipe = _FP8[trainer.fp8_recipe]
        fields.update(fp8=fmt, fp8_recipe=recipe)
    if gpu and numerics.deterministic(trainer.deterministic, gpu=True):
        fields.update(deterministic_mode=True)  # numerics.configure has set the env TE needs for it
    if parallel.pp_layer_split is not None:
        # explicit uneven split -> Megatron's pipeline layout ("E" embedding, "t" layer, "L" loss)
        stages = []
        for r, n in enumerate(parallel.pp_layer_split):
            stages.append(("E" if r == 0 else "") + "t" * n + ("L" if r == layout.pp - 1 else ""))
        fields["pipeline_model_parallel_layout"] = "|".join(stages)
    return fields


def build_transformer_config(spec: ArchSpec, arch: ModelArch, model: ModelConfig, parallel: ParallelConfig,
                             trainer: TrainerConfig, layout: Layout):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields: dict[str, Any] = spec.transformer_config(arch)
    fields["activation_func"] = _ACTIVATIONS[fields["activation_func"]]
    fields.update(layout_fields(arch, model, parallel, trainer, layout))
    fields.update(
        # Initialisation must "run": with perform_initialization=False megatron-core also skips
        # set_tensor_model_parallel_attributes (tensor_parallel/layers.py), so TP-sharded weights
        # look like TP duplicates to the grad-norm / clipping code. The init methods are no-ops
        # instead, since every parameter is then loaded from the HF checkpoint.
        perform_initialization=True,
        init_method=_no_init,
        output_layer_init_method=_no_init,
    )
    config = TransformerConfig(**fields)
    for key, value in spec.config_attributes(arch).items():  # yarn_*: read by GPTModel / Attention via getattr
        setattr(config, key, value)
    return config


def _apply_llama3_scaling(model: torch.nn.Module, spec: ArchSpec, arch: ModelArch) -> None:
    """A llama3 RoPE scaling whose low/high_freq_factor or original max positions differ from the
    values GPTModel(rope_scaling=True) hard-codes: re-derive inv_freq with Megatron's own
    `RotaryEmbedding._apply_scaling`, from the unscaled frequencies of a plain RotaryEmbedding."""
    args = spec.llama3_inv_freq_args(arch)
    if args is None:
        return
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rot = cast(RotaryEmbedding, model.rotary_pos_emb)
    plain = RotaryEmbedding(kv_channels=arch.head_dim, rotary_percent=1.0,
                            rotary_base=arch.rope_theta,  # pyright: ignore[reportArgumentType]  # a float works (typed int)
                            use_cpu_initialization=True).inv_freq
    rot.inv_freq = rot._apply_scaling(plain.to(rot.inv_freq.device), **args)
    rot.forward.cache_clear()  # forward is lru_cached on the sequence length


def _te_block_spec(config, vp_stage, pp_rank, *, unfused_norms: bool = False):
    """The TE decoder block spec. `unfused_norms` (LoRA): TE's fused layernorm + column-parallel
    linear (linear_qkv, linear_fc1) becomes TENorm + TEColumnParallelLinear, so that the linear's
    input is the normalised hidden state the adapter needs (the bridge maps both namings)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm",
                                       vp_stage=vp_stage, pp_rank=pp_rank)
    if not unfused_norms:
        return block
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TELayerNormColumnParallelLinear,
        TENorm,
    )
    from megatron.core.transformer.identity_op import IdentityOp

    from mlrl.trainer.rank.local_spec import _replace

    assert block.layer_specs is not None  # always set by get_gpt_decoder_block_spec
    layer_specs = []
    for spec in block.layer_specs:
        # the spec tree's submodules are typed `object` in megatron-core
        fused = spec.submodules.self_attention.submodules.linear_qkv is TELayerNormColumnParallelLinear  # pyright: ignore[reportAttributeAccessIssue]
        mlp = getattr(spec.submodules.mlp, "submodules", None)  # pyright: ignore[reportAttributeAccessIssue]
        fused_mlp = getattr(mlp, "linear_fc1", None) is TELayerNormColumnParallelLinear
        spec = _replace(spec, TELayerNormColumnParallelLinear, TEColumnParallelLinear)
        changes = {}
        if fused and spec.submodules.input_layernorm is IdentityOp:
            changes["input_layernorm"] = TENorm
        if fused_mlp and spec.submodules.pre_mlp_layernorm is IdentityOp:
            changes["pre_mlp_layernorm"] = TENorm
        if changes:
            spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **changes))
        layer_specs.append(spec)
    block.layer_specs = layer_specs
    return block


def build_model_chunks(spec: ArchSpec, arch: ModelArch, config, layout: Layout, *,
                       overrides: dict[str, Any] | None = None, unfused_norms: bool = False) -> list[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage held by this rank (one without VPP), on device.
    `overrides` replace GPTModel arguments of the spec (the critic: no tied output layer);
    `unfused_norms`: LoRA on the TE spec (see `_te_block_spec`; the local spec never fuses)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    kwargs = {**spec.gpt_model_kwargs(arch), **(overrides or {})}
    kwargs["vocab_size"] = padded_vocab_size(arch.vocab_size, layout.tp)
    vpp = config.virtual_pipeline_model_parallel_size
    pp_rank = ps.get_pipeline_model_parallel_rank()
    chunks = []
    for vp in range(vpp or 1):
        vp_stage = vp if vpp else None
        if use_te():
            block = _te_block_spec(config, vp_stage, pp_rank, unfused_norms=unfused_norms)
        else:
            from mlrl.trainer.rank.local_spec import local_block_spec

            block = local_block_spec(config, vp_stage, pp_rank)
        first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        with cpu_compat.cuda_tensor_methods():  # tied embeddings with PP call weight.data.cuda()
            # a TransformerBlockSubmodules is accepted (typed as ModuleSpec)
            model = GPTModel(config=config, transformer_layer_spec=block,  # pyright: ignore[reportArgumentType]
                             pre_process=first, post_process=last, parallel_output=True, vp_stage=vp_stage, **kwargs)
        _apply_llama3_scaling(model, spec, arch)
        if use_te():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks

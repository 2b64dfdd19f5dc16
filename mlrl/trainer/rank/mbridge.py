"""`model.bridge=megatron-bridge`: NVIDIA megatron-bridge's `AutoBridge` builds, loads and
exports the policy for an architecture mlrl's own bridge (mlrl.bridge) does not cover.

Why this exists beside mlrl.bridge: the built-in bridge is pure torch, bit-exact and carries
mlrl's LoRA, critic and router-replay layouts, but knows only the llama / qwen family.
megatron-bridge knows many more architectures (its model providers and parameter mappings), so
for those the policy hands it three jobs and keeps everything else (DDP, optimizer, schedules,
packed inputs, dist-checkpointing, the weight-sync senders) unchanged:

- build: `AutoBridge.from_hf_pretrained(hf_dir).to_megatron_provider(load_weights=False)` gives a
  `GPTModelProvider` (itself a `TransformerConfig`); mlrl sets the layout / precision fields the
  built-in path sets (`model.layout_fields`), `finalize()`s it and builds the chunks unwrapped
  (mlrl wraps DDP itself, as for the built-in path);
- import: `AutoBridge.load_hf_weights(chunks[, hf_path])` (TP / PP / EP sharding is the bridge's);
- export: `AutoBridge.export_hf_weights(chunks)`, a collective that hands EVERY rank every full HF
  tensor (PP stages broadcast theirs). mlrl's senders expect one sender per stage yielding its
  stage's tensors: here the sender of stage 0 yields the whole model and the other stage senders
  yield nothing (the transports and the HF export take any split of names over senders).

GPU environment only (megatron-bridge needs Python >= 3.12 and Transformer Engine; validation
rejects it on CPU, naming the package). Its tests are in tests/gpu/trainer/test_mbridge_gpu.py.
Not carried on this path (validation rejects them): LoRA, the critic's value head, router replay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch

from mlrl.bridge import BridgeError, ModelArch
from mlrl.bridge.arch import rope_theta


def generic_arch(hf: dict[str, Any]) -> ModelArch:
    """The facts mlrl itself reads off a model (vocabulary, window, MoE or not, sizes for the
    planner and the checkpoint record) from common HF config keys, for a model_type the built-in
    bridge has no spec for. Conversion never uses this: megatron-bridge does the mapping."""
    def get(*keys: str, default: Any = 0) -> Any:
        for k in keys:
            if hf.get(k) is not None:
                return hf[k]
        return default

    hidden = int(get("hidden_size", "d_model", "n_embd"))
    if not (hidden and get("vocab_size") and get("num_hidden_layers", "n_layer")):
        raise BridgeError(f"config.json (model_type={hf.get('model_type')!r}): hidden_size, vocab_size and "
                          "num_hidden_layers are needed, some are missing")
    heads = int(get("num_attention_heads", "n_head", default=1))
    try:
        theta = rope_theta(hf)
    except ValueError:
        theta = 0.0  # learned / absolute positions: not a RoPE model
    experts = int(get("num_experts", "num_local_experts", "n_routed_experts"))
    return ModelArch(
        model_type=str(hf.get("model_type")), vocab_size=int(get("vocab_size")), hidden_size=hidden,
        num_layers=int(get("num_hidden_layers", "n_layer")), num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads", default=heads)),
        head_dim=int(get("head_dim", default=hidden // max(heads, 1))),
        ffn_hidden_size=int(get("intermediate_size", "ffn_dim", "n_inner")),
        norm_eps=float(get("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", default=1e-5)),
        rope_theta=theta, max_position_embeddings=int(get("max_position_embeddings", "n_positions")),
        tie_embeddings=bool(get("tie_word_embeddings", default=False)),
        num_experts=experts, moe_topk=int(get("num_experts_per_tok", "moe_topk")) if experts else 0,
        moe_ffn_hidden_size=int(get("moe_intermediate_size")) if experts else 0,
        sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", True) else None,
    )


class MBridge:
    """One policy's megatron-bridge: the provider (its TransformerConfig) and the AutoBridge."""

    def __init__(self, hf_dir: Path, fields: dict[str, Any]):
        """`fields`: mlrl's layout / precision / loss-accounting TransformerConfig fields
        (mlrl.trainer.rank.model.layout_fields), set on the provider over its own defaults so
        the schedules, DDP and the loss contract see what the built-in path gives them."""
        from megatron.bridge import AutoBridge  # pyright: ignore[reportMissingImports]  # the GPU env's `bridge` extra

        self.hf_dir = Path(hf_dir)
        self.auto = AutoBridge.from_hf_pretrained(str(self.hf_dir), torch_dtype=fields["params_dtype"])
        provider = self.auto.to_megatron_provider(load_weights=False)
        for key, value in fields.items():
            setattr(provider, key, value)
        provider.finalize()
        self.config = provider  # a GPTModelProvider is a TransformerConfig

    def build_chunks(self) -> list[torch.nn.Module]:
        """This rank's model chunks (one per virtual pipeline stage), on the GPU, not wrapped:
        the policy wraps DDP and builds the optimizer itself. Weights are loaded next (`MBridgeParams.load_initial`)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        return self.config.provide_distributed_model(
            wrap_with_ddp=False, mixed_precision_wrapper=None,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups())


class MBridgeParams:
    """The policy's weights seen through megatron-bridge: the same two calls as
    mlrl.trainer.rank.weights.LocalParams (`load_hf`, `iter_hf`), so the policy, the weight sync
    and the HF export do not branch on the bridge."""

    def __init__(self, bridge: MBridge, chunks: list[torch.nn.Module], ranks):
        self.bridge, self.chunks, self.ranks = bridge, chunks, ranks

    def load_initial(self) -> None:
        """Collective: model.hf_dir's weights (the folder the bridge was made from)."""
        self.bridge.auto.load_hf_weights(self.chunks)

    def load_hf(self, ckpt) -> None:
        """Collective: the HF folder `ckpt.dir` (an `HFCheckpoint`) into the chunks."""
        self.bridge.auto.load_hf_weights(self.chunks, hf_path=str(ckpt.dir))

    def iter_hf(self, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: (HF name, full tensor). Every rank must exhaust it (megatron-bridge gathers
        over TP / EP and broadcasts over PP); only the sender of stage 0 yields (module docstring)."""
        if grads:
            raise ValueError("iter_hf(grads=True) with model.bridge=megatron-bridge: megatron-bridge exports weights, "
                             "not gradients; use the built-in bridge (model.bridge=builtin)")
        emit = self.ranks.is_stage_sender and self.ranks.pp == 0
        for name, tensor in self.bridge.auto.export_hf_weights(self.chunks, cpu=False, show_progress=False):
            if emit:
                yield name, tensor


def supported_architectures() -> list[str]:
    """The HF architectures megatron-bridge converts (tools/convert_checkpoint.py --list)."""
    from megatron.bridge import AutoBridge  # pyright: ignore[reportMissingImports]  # the GPU env's `bridge` extra

    return sorted(AutoBridge.list_supported_models())

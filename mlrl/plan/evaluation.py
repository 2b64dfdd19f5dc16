"""`evaluation_plan(cfg)`: what `--dry-run` prints for an evaluation run (`evaluate:` section),
which starts engines only: where each engine goes and, on GPUs, its memory (the engine estimate
of mlrl.plan.memory: weights, activations, runtime, and the KV cache left within
gpu_memory_utilization), for the policy's engines and the judge's. Like `format_plan`, the last
line is the verdict (`fits` or `DOES NOT FIT`). A classifier judge is sized as a language model
(its LM head and logits counted: the safe side)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlrl.config.loader import ConfigError
from mlrl.config.schema import Config, RolloutConfig
from mlrl.modelzoo import ModelSpecError, hf_config_dict
from mlrl.plan import memory as mem
from mlrl.plan.model import ModelShape, model_shape

# the model families mlrl.plan.model reads exactly (others are sized as if they were one of them)
SIZED_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")


@dataclass
class EvaluationPlan:
    lines: list[str]
    reasons: list[str] = field(default_factory=list)  # why it does not fit (empty = fits)

    @property
    def fits(self) -> bool:
        return not self.reasons

    def text(self) -> str:
        verdict = "fits" if self.fits else "DOES NOT FIT: " + "; ".join(self.reasons)
        return "\n".join([*self.lines, verdict])


def evaluation_plan(cfg: Config) -> EvaluationPlan:
    c = cfg.cluster
    plan = EvaluationPlan([])
    pools = [("policy", "model.hf_dir", "rollout", cfg.model.hf_dir, cfg.model.arch, cfg.rollout)]
    if cfg.reward_model is not None:
        rm = cfg.reward_model
        pools.append((f"judge ({rm.kind})", "reward_model.hf_dir", "reward_model", rm.hf_dir, None,
                      rm.engines(cfg.rollout)))
    if c.gpus_per_node == 0:
        plan.lines.append("cluster  this machine, CPU only (cluster.gpus_per_node=0): the engines share the cores; "
                          "no trainer (an evaluation)")
    else:
        plan.lines.append(f"cluster  1 node x {c.gpus_per_node} GPUs of {c.gpu_memory_gb:g} GiB; no trainer (an "
                          "evaluation)")
    first = 0
    for role, field_name, section, spec, arch, r in pools:
        gpus = ""
        if c.gpus_per_node:
            groups = [list(range(first + e * r.engine_tp, first + (e + 1) * r.engine_tp)) for e in range(r.num_engines)]
            first += r.num_engines * r.engine_tp
            gpus = ": GPUs " + ", ".join("-".join(str(g) for g in sorted({x[0], x[-1]})) for x in groups)
        try:
            shape = model_shape(hf_config_dict(spec, arch, field=field_name), arch or spec)
        except ModelSpecError as e:  # a judge folder that is not on this machine (no preset to plan it from)
            if role == "policy":
                raise ConfigError(str(e)) from None
            plan.lines.append(f"engines  {role} {spec}: {r.num_engines} engine(s) x engine_tp {r.engine_tp}{gpus}; "
                              f"not sized ({e})")
            continue
        kind = f"MoE, {shape.experts} experts top-{shape.top_k}" if shape.is_moe else "dense"
        n = shape.total_params()
        size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
        plan.lines.append(f"engines  {role} {spec} ({shape.model_type}, {size} parameters, {kind}): {r.num_engines} "
                          f"engine(s) x engine_tp {r.engine_tp}{gpus}")
        if shape.model_type not in SIZED_FAMILIES:
            plan.lines.append(f"note     {role}: the estimate reads {shape.model_type} as a Llama / Qwen-style "
                              "transformer (full attention, one KV head set per layer); check it against vLLM's log")
        _engine_memory(cfg, role, section, shape, r, plan)
    return plan


def _engine_memory(cfg: Config, role: str, section: str, shape: ModelShape, r: RolloutConfig,
                   plan: EvaluationPlan) -> None:
    """One engine GPU of the pool (or, on CPU, its KV cache), and whether a whole sequence fits."""
    max_len = r.max_model_len or shape.max_positions or cfg.data.max_prompt_tokens + r.sampling.max_new_tokens
    dtype = mem.DTYPE_BYTES[cfg.model.dtype]
    if cfg.cluster.gpus_per_node == 0:
        kv_per_token = mem.kv_bytes_per_token(shape, engine_tp=r.engine_tp, dtype_bytes=dtype)
        tokens = int(r.cpu_kv_cache_gb * mem.GIB // kv_per_token)
        plan.lines.append(f"memory   {role} engine: KV cache {r.cpu_kv_cache_gb:g} GiB (cpu_kv_cache_gb) = {tokens} "
                          f"tokens, {tokens // max_len} sequence(s) of max_model_len {max_len}")
    else:
        e = mem.engine_memory(shape, engine_tp=r.engine_tp, dtype_bytes=dtype, gpu_bytes=cfg.cluster.gpu_memory_gb
                              * mem.GIB, utilization=r.gpu_memory_utilization, max_model_len=max_len,
                              enforce_eager=r.enforce_eager)
        tokens = e.kv_tokens
        plan.lines.append(f"memory   {role} engine GPU: weights {e.weights / mem.GIB:.2f} + activations "
                          f"{e.activations / mem.GIB:.2f} + runtime {e.runtime / mem.GIB:.2f} GiB of "
                          f"{e.budget / mem.GIB:.2f} (gpu_memory_utilization {r.gpu_memory_utilization:g}); KV cache "
                          f"{max(0.0, e.kv_cache) / mem.GIB:.2f} GiB = {tokens} tokens, {tokens // max_len} "
                          f"sequence(s) of max_model_len {max_len}")
    if tokens < max_len:
        more = (f"a larger {section}.cpu_kv_cache_gb" if cfg.cluster.gpus_per_node == 0 else
                f"more GPUs per engine ({section}.engine_tp), a larger {section}.gpu_memory_utilization")
        plan.reasons.append(f"{role} engine: its KV cache holds {tokens} tokens, less than one sequence of "
                            f"max_model_len {max_len} ({more}, or a smaller {section}.max_model_len)")

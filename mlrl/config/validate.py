"""Cross-field validation, run once before any process starts.

Every rule raises `ConfigError` with one line that names the field(s) and what was expected.
Rules that depend on the model read its HF config (config.json, a builtin, or a preset), never
its weights; they live in `mlrl.config.validate_model`. `resolve_layout` derives the trainer
device count (cluster.trainer_devices, or from the cluster) and dp = trainer devices /
(tp*pp*cp); everything that needs them (launcher, dry-run planner, trainer) takes them from there.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlrl.bridge.arch import is_sequence_classifier
from mlrl.config.loader import ConfigError
from mlrl.config.schema import LORA_TARGETS, OFFLINE_KINDS, Config, DataConfig, OptimizerConfig, WorkflowConfig
from mlrl.config.validate_model import (
    check_arch,
    check_arch_preset,
    check_bridge,
    check_model,
    classifier_labels,
    routing_capture_problem,
)
from mlrl.modelzoo import ModelSpecError, hf_config_dict


@dataclass(frozen=True)
class Layout:
    """The resolved parallel layout of the trainer."""

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    vpp: int | None
    trainer_devices: int      # tp * pp * cp * dp
    rollout_devices: int      # num_engines * engine_tp (0 on CPU: engines share the cores)
    total_devices: int        # nodes * gpus_per_node (0 on CPU)


def _positive(name: str, value: Any, minimum: float = 1) -> None:
    if value is not None and value < minimum:
        raise ConfigError(f"{name}: got {value}, expected >= {minimum}")


def _check_lr(section: str, o: OptimizerConfig) -> None:
    if not o.lr > 0:
        raise ConfigError(f"{section}.lr: got {o.lr}, expected > 0")
    if o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"{section}.min_lr: got {o.min_lr}, expected 0 <= min_lr <= {section}.lr ({o.lr})")


def _check_ranges(cfg: Config) -> None:
    p, t, r, a, s = cfg.parallel, cfg.trainer, cfg.rollout, cfg.algorithm, cfg.rollout.sampling
    for name, seed in (("trainer.seed", t.seed), ("rollout.sampling.seed", s.seed)):
        if seed is not None and not 0 <= seed < 2**63:  # torch.manual_seed / vLLM's take 64-bit seeds
            raise ConfigError(f"{name}: got {seed}, expected 0 <= seed < 2**63")
    _positive("weight_sync.canary_every", cfg.weight_sync.canary_every)
    if cfg.weight_sync.canary_every != 1 and cfg.weight_sync.canary_tolerance_for(cfg.model.dtype) <= 0:
        raise ConfigError(f"weight_sync.canary_every={cfg.weight_sync.canary_every} with the canary off "
                          "(weight_sync.canary_tolerance <= 0): set a tolerance or leave canary_every at 1")
    for name in ("tp", "pp", "ep", "cp"):
        _positive(f"parallel.{name}", getattr(p, name))
    _positive("parallel.etp", p.etp)
    if p.vpp is not None:
        _positive("parallel.vpp", p.vpp)
    for name in ("prompts_per_step", "samples_per_prompt", "mini_batches_per_step", "epochs_per_step",
                 "total_steps"):
        _positive(f"trainer.{name}", getattr(t, name))
    if t.micro_batch_tokens != "auto":
        _positive("trainer.micro_batch_tokens", t.micro_batch_tokens)
    _positive("cluster.trainer_devices", cfg.cluster.trainer_devices)
    _check_lr("trainer", t)
    for name in ("lr_warmup_steps",):
        _positive(f"trainer.{name}", getattr(t, name), 0)
    updates = cfg.policy_updates  # the policy's: critic-only steps do not update it
    if t.lr_warmup_steps and t.lr_warmup_steps >= updates:
        less = " less the critic.critic_only_steps'" if updates != t.total_updates else ""
        raise ConfigError(
            f"trainer.lr_warmup_steps={t.lr_warmup_steps} must be smaller than the optimizer updates of the run "
            f"(trainer.total_steps * mini_batches_per_step * epochs_per_step{less} = {updates})"
        )
    if t.grad_clip < 0:
        raise ConfigError(f"trainer.grad_clip: got {t.grad_clip}, expected >= 0 (0 = off)")
    if t.weight_decay < 0:
        raise ConfigError(f"trainer.weight_decay: got {t.weight_decay}, expected >= 0")
    if not (0 <= t.adam_beta1 < 1 and 0 <= t.adam_beta2 < 1):
        raise ConfigError(f"trainer.adam_beta1/adam_beta2: got {t.adam_beta1}/{t.adam_beta2}, expected in [0, 1)")
    if t.prompts_per_step % t.mini_batches_per_step:
        raise ConfigError(
            f"trainer.mini_batches_per_step={t.mini_batches_per_step} must divide the prompt groups of a step "
            f"(trainer.prompts_per_step={t.prompts_per_step}): a mini-batch holds whole groups"
        )
    _positive("rollout.num_engines", r.num_engines)
    _positive("rollout.engine_tp", r.engine_tp)
    _positive("rollout.max_concurrent_requests", r.max_concurrent_requests)
    if r.staleness < 0:
        raise ConfigError(f"rollout.staleness: got {r.staleness}, expected >= 0 (0 = synchronous)")
    if s.temperature < 0:
        raise ConfigError(f"rollout.sampling.temperature: got {s.temperature}, expected >= 0 (0 = greedy)")
    if s.temperature == 0:  # greedy: vLLM refuses n > 1 (a group-native workflow's request), and the answers are one
        ks = [("eval.samples_per_prompt", cfg.eval.samples_per_prompt)] if cfg.data.held_out() else []
        if cfg.offline is None and cfg.evaluate is None:
            ks.insert(0, ("trainer.samples_per_prompt", cfg.trainer.samples_per_prompt))
        for name, k in ks:
            if k > 1:
                raise ConfigError(f"rollout.sampling.temperature=0 (greedy) with {name}={k}: the {k} answers to a "
                                  f"prompt would be one answer {k} times (and vLLM refuses greedy requests for n > 1); "
                                  f"sample with temperature > 0, or set {name}=1")
    if not 0 < s.top_p <= 1:
        raise ConfigError(f"rollout.sampling.top_p: got {s.top_p}, expected in (0, 1]")
    for i, text in enumerate(s.stop):
        if not isinstance(text, str) or not text:
            raise ConfigError(f"rollout.sampling.stop[{i}]={text!r}: expected a non-empty string (generation ends "
                              "where the response contains it)")
    for i, tid in enumerate(s.stop_token_ids):
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise ConfigError(f"rollout.sampling.stop_token_ids[{i}]={tid!r}: expected a token id (an integer >= 0)")
    if s.top_k == 0 or s.top_k < -1:
        raise ConfigError(f"rollout.sampling.top_k: got {s.top_k}, expected -1 (off) or >= 1")
    _positive("rollout.sampling.max_new_tokens", s.max_new_tokens)
    if not 0 < r.gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.gpu_memory_utilization: got {r.gpu_memory_utilization}, expected in (0, 1]")
    if r.startup_timeout_s <= 0 or r.request_timeout_s <= 0:
        raise ConfigError("rollout.startup_timeout_s / request_timeout_s: expected > 0 seconds")
    if not cfg.trainer.startup_timeout_s > 0:
        raise ConfigError(f"trainer.startup_timeout_s={cfg.trainer.startup_timeout_s}: expected > 0 seconds")
    if cfg.weight_sync.bucket_mb <= 0:
        raise ConfigError(f"weight_sync.bucket_mb: got {cfg.weight_sync.bucket_mb}, expected > 0")
    if a.eps_clip <= 0 or (a.eps_clip_high is not None and a.eps_clip_high <= 0):
        raise ConfigError("algorithm.eps_clip / eps_clip_high: expected > 0")
    if a.dual_clip_c <= 1:
        raise ConfigError(f"algorithm.dual_clip_c: got {a.dual_clip_c}, expected > 1")
    if a.kl_coef < 0 or a.entropy_coef < 0:
        raise ConfigError("algorithm.kl_coef / entropy_coef: expected >= 0 (0 = off)")
    if a.rollout_is_cap < 1:
        raise ConfigError(f"algorithm.rollout_is_cap: got {a.rollout_is_cap}, expected >= 1")
    if not 0 < a.icepop_low < a.icepop_high or not a.icepop_low <= 1 <= a.icepop_high:
        raise ConfigError(f"algorithm.icepop_low / icepop_high: got [{a.icepop_low}, {a.icepop_high}], expected "
                          "0 < icepop_low <= 1 <= icepop_high with icepop_low < icepop_high")
    _positive("algorithm.dynamic_sampling.max_rounds", a.dynamic_sampling.max_rounds)
    if not a.std_normalize and a.advantage not in ("grpo", "gae"):
        raise ConfigError(f"algorithm.std_normalize=false has no effect with algorithm.advantage={a.advantage!r} "
                          "(only grpo and gae normalise); leave it true")
    if a.use_rollout_logprobs and a.rollout_is != "none":
        raise ConfigError(f"algorithm.use_rollout_logprobs=true makes the behaviour logprobs the rollout's, so "
                          f"algorithm.rollout_is={a.rollout_is!r} would have nothing to correct: set one of them off")
    _positive("eval.samples_per_prompt", cfg.eval.samples_per_prompt)
    if not 0 <= a.gamma <= 1 or not 0 <= a.lam <= 1:
        raise ConfigError("algorithm.gamma / lam: expected in [0, 1]")
    if a.overlong_buffer < 0 or a.overlong_buffer >= s.max_new_tokens and a.overlong_buffer:
        raise ConfigError(
            f"algorithm.overlong_buffer: got {a.overlong_buffer}, expected 0 (off) or < "
            f"rollout.sampling.max_new_tokens ({s.max_new_tokens})"
        )
    _positive("cluster.nodes", cfg.cluster.nodes)
    _positive("cluster.gpus_per_node", cfg.cluster.gpus_per_node, 0)
    if cfg.cluster.join_timeout_s <= 0:
        raise ConfigError(f"cluster.join_timeout_s: got {cfg.cluster.join_timeout_s}, expected > 0 (seconds)")
    _positive("checkpoint.keep_last", cfg.checkpoint.keep_last, 0)
    _positive("checkpoint.save_every", cfg.checkpoint.save_every, 0)
    _positive("data.max_prompt_tokens", cfg.data.max_prompt_tokens)
    _positive("workflow.max_concurrency", cfg.workflow.max_concurrency)
    w = cfg.workflow
    if w.episode_timeout_s < 0:
        raise ConfigError(f"workflow.episode_timeout_s: got {w.episode_timeout_s}, expected >= 0 seconds (0 = off)")
    if not w.reward_timeout_s > 0:
        raise ConfigError(f"workflow.reward_timeout_s: got {w.reward_timeout_s}, expected > 0 seconds")
    _positive("workflow.reward_workers", w.reward_workers, 0)
    _positive("checkpoint.hf_export_every", cfg.checkpoint.hf_export_every, 0)
    _positive("data.eval_every", cfg.data.eval_every, 0)
    if r.max_model_len is not None:
        _positive("rollout.max_model_len", r.max_model_len)
    if not cfg.cluster.gpu_memory_gb > 0:
        raise ConfigError(f"cluster.gpu_memory_gb: got {cfg.cluster.gpu_memory_gb}, expected > 0 (GiB per GPU)")
    _positive("workflow.max_failure_steps", cfg.workflow.max_failure_steps)
    if not 0.0 <= cfg.workflow.max_failure_fraction < 1.0:
        raise ConfigError(f"workflow.max_failure_fraction: got {cfg.workflow.max_failure_fraction}, expected a "
                          "fraction in [0, 1) (a step in which every episode failed always stops the run)")


def _check_critic(cfg: Config) -> None:
    a, c, t = cfg.algorithm, cfg.critic, cfg.trainer
    if a.advantage == "gae" and c is None:
        raise ConfigError("algorithm.advantage=gae needs a critic: add a `critic:` section (e.g. critic.lr=1e-5; "
                          "see mlrl/config/schema.py CriticConfig)")
    if c is None:
        return
    # the ranges hold for a section a recipe carries for gae runs too: a typo shows before the switch
    _check_lr("critic", c)
    for name in ("lr_warmup_steps", "critic_only_steps"):
        _positive(f"critic.{name}", getattr(c, name), 0)
    if c.grad_clip < 0 or c.weight_decay < 0 or c.value_clip < 0:
        raise ConfigError("critic.grad_clip / weight_decay / value_clip: expected >= 0 (0 = off)")
    if not cfg.uses_critic:
        return
    if c.critic_only_steps >= t.total_steps:
        raise ConfigError(f"critic.critic_only_steps={c.critic_only_steps} (critic-only RL steps) must be smaller "
                          f"trainer.total_steps={t.total_steps}")
    if c.lr_warmup_steps and c.lr_warmup_steps >= t.total_updates:
        raise ConfigError(
            f"critic.lr_warmup_steps={c.lr_warmup_steps} must be smaller than the critic's updates of the run"
        )


def _check_lora(cfg: Config, hf: dict[str, Any] | None = None) -> None:
    """model.lora ranges and the combinations it does not support; hf (the model's config.json)
    for the model-dependent rules."""
    lora, ws = cfg.model.lora, cfg.weight_sync
    if lora is None:
        if not cfg.checkpoint.export_merged:
            raise ConfigError("checkpoint.export_merged=false applies to LoRA runs only (model.lora is off: the "
                              "export is the full model)")
        if ws.lora_mode != "merged":
            raise ConfigError(f"weight_sync.lora_mode={ws.lora_mode!r} needs model.lora (LoRA is off); "
                              "remove it or set e.g. model.lora.rank=16")
        return
    if lora.rank <= 0:
        raise ConfigError(f"model.lora.rank: got {lora.rank}, expected > 0")
    if not lora.alpha > 0:
        raise ConfigError(f"model.lora.alpha: got {lora.alpha}, expected > 0")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"model.lora.dropout: got {lora.dropout}, expected in [0, 1)")
    valid = (*LORA_TARGETS, "all-linear")
    unknown = [t for t in lora.target_modules if t not in valid]
    if unknown or not lora.target_modules:
        what = f"unknown target module {unknown[0]!r}" if unknown else "an empty list"
        raise ConfigError(f"model.lora.target_modules: {what}; valid names: {', '.join(valid)}")
    if ws.lora_mode == "adapter" and lora.rank > 512:
        raise ConfigError(f"model.lora.rank={lora.rank}: weight_sync.lora_mode=adapter serves the adapter with vLLM, "
                          "which takes ranks up to 512; use lora_mode=merged")
    if ws.lora_mode == "adapter" and ws.transport != "disk":
        raise ConfigError(f"weight_sync.lora_mode=adapter hands the engines a PEFT adapter folder under "
                          f"weight_sync.disk_dir: set weight_sync.transport=disk (got {ws.transport!r})")
    if hf is not None and (hf.get("num_experts") or hf.get("num_local_experts")):
        mlp = [t for t in lora.targets if t in ("gate_proj", "up_proj", "down_proj")]
        if mlp:
            raise ConfigError(f"model.lora.target_modules: {', '.join(mlp)} on a MoE model (experts) is not "
                              "supported yet; adapt the attention only (q_proj, k_proj, v_proj, o_proj)")


_RUN_NAMES = {"sft": "an SFT run", "dpo": "a DPO run", "rm": "a reward-model run"}
_OFFLINE_UNUSED = ("rollout", "weight_sync", "algorithm", "workflow", "eval")
_OFFLINE_UNUSED_TRAINER = ("prompts_per_step", "samples_per_prompt", "mini_batches_per_step", "epochs_per_step")


def check_micro_batch_budget(cfg: Config) -> None:
    """An SFT conversation / a DPO pair must fit one micro-batch (checked again once `auto` is
    resolved: mlrl.plan.planner.resolve_micro_batch_tokens)."""
    budget = cfg.trainer.micro_batch_tokens
    if budget == "auto":
        return
    if cfg.sft is not None and cfg.sft.max_seq_tokens > budget:
        raise ConfigError(f"sft.max_seq_tokens={cfg.sft.max_seq_tokens} exceeds trainer.micro_batch_tokens="
                          f"{budget}: a conversation must fit one micro-batch")
    d = cfg.offline_section
    if cfg.trains_on_pairs and d is not None and 2 * d.max_seq_tokens > budget:
        raise ConfigError(f"{cfg.offline}.max_seq_tokens={d.max_seq_tokens}: a pair (chosen + rejected, up to "
                          f"{2 * d.max_seq_tokens} tokens) must fit one micro-batch, but "
                          f"trainer.micro_batch_tokens={budget}; raise it to >= {2 * d.max_seq_tokens}")


def _refuse_set_fields(cfg: Config, sections: tuple[str, ...], why: str) -> None:
    """Every field of `sections` set away from its default is refused as `<section>.<field>: <why>`."""
    import dataclasses

    default = Config()
    for section in sections:
        got, want = getattr(cfg, section), getattr(default, section)
        for f in dataclasses.fields(got):
            if getattr(got, f.name) != getattr(want, f.name):
                raise ConfigError(f"{section}.{f.name}: {why}")


def _check_offline(cfg: Config) -> None:
    """An SFT or DPO run (the trainer alone on a fixed dataset): its own ranges, and no RL setting
    that it would silently ignore."""

    kind = cfg.offline
    s = cfg.offline_section
    if kind is None or s is None:
        return
    both = [name for name in OFFLINE_KINDS if getattr(cfg, name) is not None]
    if len(both) > 1:
        raise ConfigError(f"{' and '.join(both)}: a run is supervised fine-tuning (sft), preference optimisation "
                          "(dpo) OR reward-model training (rm); keep one section")
    run = f"{_RUN_NAMES[kind]} ({kind}: section)"
    _positive(f"{kind}.batch_size", s.batch_size)
    _positive(f"{kind}.max_seq_tokens", s.max_seq_tokens)
    check_micro_batch_budget(cfg)
    if cfg.dpo is not None:
        d = cfg.dpo
        if not d.beta > 0:
            raise ConfigError(f"dpo.beta={d.beta}: expected > 0")
        if d.loss_type not in ("sigmoid", "ipo"):
            raise ConfigError(f"dpo.loss_type={d.loss_type!r}: expected sigmoid (DPO) or ipo (IPO)")
    if cfg.rm is not None:
        r = cfg.rm
        if not (r.center_rewards_coefficient >= 0 and math.isfinite(r.center_rewards_coefficient)):
            raise ConfigError(f"rm.center_rewards_coefficient={r.center_rewards_coefficient}: expected a finite "
                              "number >= 0 (0 = off)")
        if cfg.model.lora is not None:
            raise ConfigError(f"model.lora: {run} trains every weight of the reward model (its scalar head is new); "
                              "remove model.lora")
        if cfg.parallel.cp > 1:
            raise ConfigError(f"parallel.cp={cfg.parallel.cp}: {run} reads each sequence's last position, which "
                              "context parallelism splits across ranks; use parallel.cp=1")
        if cfg.model.init_from:
            raise ConfigError(f"model.init_from={cfg.model.init_from}: {run} starts from a Hugging Face folder "
                              "(model.hf_dir; e.g. an SFT run's export <run>/hf/step_N), whose LM head it replaces")
    if cfg.critic is not None:
        raise ConfigError(f"critic: {run} trains no value model; remove the critic section")
    if cfg.cluster.nodes > 1:
        raise ConfigError(f"cluster.nodes={cfg.cluster.nodes}: {run} runs on one machine (its trainer ranks) for now")
    default = Config()
    _refuse_set_fields(cfg, _OFFLINE_UNUSED, f"an RL setting; {run} does not use it (remove it, or remove the {kind} "
                       "section for an RL run)")
    if cfg.trainer.shared_prefix_packing == "always":
        raise ConfigError(f"trainer.shared_prefix_packing=always: an RL setting (one prompt shared by a group of "
                          f"sampled responses); {run} packs no prompt groups")
    unit = "conversations" if kind == "sft" else "preference pairs"
    for name in _OFFLINE_UNUSED_TRAINER:
        if getattr(cfg.trainer, name) != getattr(default.trainer, name):
            raise ConfigError(f"trainer.{name}: an RL setting; {run} takes {kind}.batch_size {unit} per step")
    if cfg.data.max_prompt_tokens != default.data.max_prompt_tokens:
        raise ConfigError(f"data.max_prompt_tokens: an RL setting; {run} cuts sequences at {kind}.max_seq_tokens")


def _check_reward_model(cfg: Config) -> None:
    """reward_model: (a judge on its own engines) and workflow.reward=reward_model go together."""
    import re

    rm = cfg.reward_model
    uses = cfg.workflow.reward == "reward_model"
    if rm is None:
        if uses and cfg.offline is None:
            raise ConfigError("workflow.reward=reward_model scores with a served judge: add a reward_model: section "
                              "(hf_dir, kind: generative, num_engines, ...)")
        return
    if cfg.offline is not None:
        raise ConfigError(f"reward_model: an RL setting; {_RUN_NAMES[cfg.offline]} scores nothing (remove the section)")
    if not uses:
        raise ConfigError(f"reward_model: the served judge scores only through workflow.reward=reward_model, but "
                          f"workflow.reward={cfg.workflow.reward}; set it, or remove the reward_model section")
    if rm.kind not in ("generative", "classifier"):
        raise ConfigError(f"reward_model.kind={rm.kind!r}: expected generative (an LLM judge) or classifier (a "
                          "sequence-classification reward model)")
    if rm.kind == "classifier":
        default = type(rm)()
        for name in ("prompt_template", "score_pattern", "max_score", "max_tokens"):
            if getattr(rm, name) != getattr(default, name):
                raise ConfigError(f"reward_model.{name}: a generative judge's setting; a classifier reward model "
                                  "scores the conversation itself (remove it, or use kind: generative)")
    if not rm.hf_dir:
        raise ConfigError("reward_model.hf_dir: the judge's Hugging Face folder (or builtin:<name>) is required")
    for name in ("num_engines", "engine_tp", "max_tokens"):
        _positive(f"reward_model.{name}", getattr(rm, name))
    if not rm.max_score > 0:
        raise ConfigError(f"reward_model.max_score={rm.max_score}: expected > 0")
    try:
        groups = re.compile(rm.score_pattern).groups
    except re.error as e:
        raise ConfigError(f"reward_model.score_pattern={rm.score_pattern!r}: not a regular expression ({e})") from None
    if groups < 1:
        raise ConfigError(f"reward_model.score_pattern={rm.score_pattern!r}: needs a group capturing the number")
    try:
        rm.prompt_template.format(question="q", response="r", answer="a")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"reward_model.prompt_template: {type(e).__name__} {e}; the placeholders are {{question}}, "
                          "{response} and {answer} (write {{ and }} for braces)") from None
    if cfg.cluster.nodes > 1:
        raise ConfigError(f"reward_model with cluster.nodes={cfg.cluster.nodes}: the judge's engines are placed on "
                          "one machine for now")
    if cfg.cluster.gpus_per_node:
        if cfg.cluster.placement == "colocated":
            raise ConfigError("reward_model with cluster.placement=colocated: the judge's engines need GPUs of their "
                              "own; use disaggregated placement")
        if rm.engine_tp != cfg.rollout.engine_tp:
            raise ConfigError(f"reward_model.engine_tp={rm.engine_tp}: on GPUs the judge's engines take slots of "
                              f"rollout.engine_tp={cfg.rollout.engine_tp} GPUs each; use the same value")


def _check_colocate_transport(cfg: Config) -> None:
    """Colocated on CUDA GPUs, the weight sync must reach engines on the trainer's own GPUs. NCCL does
    not support a group holding two ranks on one GPU (the broadcast group would: a trainer rank and
    an engine worker); CUDA IPC hands the memory of one trainer rank per pipeline stage (on its GPU)
    to every engine worker, which can map it only on that same GPU."""
    if cfg.cluster.placement != "colocated":
        return
    transport, r, pp = cfg.weight_sync.transport, cfg.rollout, cfg.parallel.pp
    if transport == "broadcast":
        raise ConfigError("weight_sync.transport=broadcast with cluster.placement=colocated on GPUs: the broadcast "
                          "group would hold a trainer rank and an engine worker on one GPU, which NCCL does not "
                          "support; use cuda_ipc (one engine GPU, parallel.pp=1) or disk")
    workers = r.num_engines * r.engine_tp
    if transport == "cuda_ipc" and (workers > 1 or pp > 1):
        raise ConfigError(f"weight_sync.transport=cuda_ipc with rollout.num_engines x engine_tp = {workers} engine "
                          f"GPU(s) and parallel.pp={pp}: one trainer rank per pipeline stage shares its GPU memory, "
                          "which only an engine worker on that same GPU can map (one engine GPU, pp=1); use "
                          "weight_sync.transport=disk")


def _check_colocate(cfg: Config) -> None:
    """cluster.placement=colocated (mlrl.colocation). On CPU it runs the whole state machine (the
    engines get vLLM's sleep / wake calls, which pause their scheduling and clear their prefix cache,
    and the trainer really offloads its optimizer state, gradients and, optionally, parameters) but the
    engines keep their memory: vLLM's CPU build has no sleep mode (metric colocate/engine_memory_released=0)."""
    c, co = cfg.cluster, cfg.cluster.colocate
    if c.placement != "colocated":
        if co != type(co)():
            raise ConfigError(f"cluster.colocate ({co}) applies only to cluster.placement=colocated, "
                              f"got placement={c.placement}")
        return
    if co.sleep_level not in (1, 2):
        raise ConfigError(f"cluster.colocate.sleep_level={co.sleep_level}: vLLM's sleep levels are 1 (weights to "
                          "host memory, KV cache discarded) and 2 (both discarded)")
    if cfg.offline is not None:
        raise ConfigError(f"cluster.placement=colocated: {_RUN_NAMES[cfg.offline]} starts no engines; use the "
                          "default placement")
    if cfg.rollout.staleness > 0:
        raise ConfigError(f"cluster.placement=colocated with rollout.staleness={cfg.rollout.staleness}: colocated "
                          "engines sleep while the trainer steps, so generation cannot overlap training; use "
                          "staleness 0, or disaggregated placement for asynchronous training")
    if co.sleep_level == 2 and c.gpus_per_node == 0:
        raise ConfigError("cluster.colocate.sleep_level=2 on CPU: vLLM's CPU worker ignores sleep (its memory stays "
                          "allocated at any level), so level 2 would behave as level 1; use sleep_level=1 on CPU")
    if co.sleep_level == 2 and cfg.model.lora is not None and cfg.weight_sync.lora_mode == "adapter":
        raise ConfigError("cluster.colocate.sleep_level=2 discards the engines' weights, but weight_sync.lora_mode="
                          "adapter syncs only the adapters, so the base would be lost; use sleep_level=1 or "
                          "lora_mode=merged")


# what an evaluation run (evaluate: section) reads: the engines (rollout), the workflow, data.eval and
# eval.*, a judge; nothing of the trainer except trainer.seed (it seeds a synthetic data.eval)
_EVALUATE_UNUSED = ("parallel", "weight_sync", "algorithm", "checkpoint")


def _check_evaluate(cfg: Config) -> None:
    """An evaluation run (the engines alone answer data.eval): its own ranges, and no training
    setting that it would silently ignore."""
    import dataclasses

    e = cfg.evaluate
    if e is None:
        return
    run = "an evaluation (evaluate: section)"
    kinds = [name for name in OFFLINE_KINDS if getattr(cfg, name) is not None]
    if kinds:
        raise ConfigError(f"evaluate and {kinds[0]}: a run trains ({kinds[0]}) OR evaluates (evaluate); keep one "
                          "section")
    if cfg.critic is not None:
        raise ConfigError(f"critic: {run} trains no value model; remove the critic section")
    if not cfg.data.held_out():
        raise ConfigError(f"data.eval: {run} answers the prompts of data.eval, which is not set (a file, a registered "
                          "name or synthetic:<task>; or data.mix with each source's eval)")
    if e.max_prompts < 0:
        raise ConfigError(f"evaluate.max_prompts={e.max_prompts}: expected >= 0 (0 = every prompt of data.eval)")
    if e.output is not None and not str(e.output).strip():
        raise ConfigError("evaluate.output is empty: expected a file path, or null for <logging.run_dir>/"
                          "eval_samples.jsonl")
    m, c = cfg.model, cfg.cluster
    if m.lora is not None:
        raise ConfigError(f"model.lora: {run} serves a whole model; evaluate a LoRA run's merged export "
                          "(<run>/hf/step_N) as model.hf_dir")
    if m.init_from:
        raise ConfigError(f"model.init_from={m.init_from}: {run} serves model.hf_dir, a Hugging Face folder; "
                          "evaluate a run's export (<run>/hf/step_N), or convert a checkpoint with "
                          "tools/convert_checkpoint.py mcore-to-hf")
    if m.bridge != "auto":
        raise ConfigError(f"model.bridge={m.bridge}: the trainer's HF <-> Megatron bridge; {run} starts no trainer "
                          "(remove it)")
    if c.nodes > 1:
        raise ConfigError(f"cluster.nodes={c.nodes}: {run} runs on one machine for now (its engines: "
                          "rollout.num_engines x rollout.engine_tp GPUs)")
    if c.placement != "disaggregated":
        raise ConfigError(f"cluster.placement={c.placement}: {run} starts no trainer to share the GPUs with; "
                          "remove it")
    if c.trainer_devices is not None:  # (cluster.gpu_memory_gb is read: --dry-run plans the engines' memory)
        raise ConfigError(f"cluster.trainer_devices={c.trainer_devices}: the trainer's devices; {run} starts no "
                          "trainer")
    default = Config()
    _refuse_set_fields(cfg, _EVALUATE_UNUSED, f"a training setting; {run} does not use it (remove it, or remove the "
                       "evaluate section for a training run)")
    for f in dataclasses.fields(cfg.trainer):
        if f.name != "seed" and getattr(cfg.trainer, f.name) != getattr(default.trainer, f.name):
            raise ConfigError(f"trainer.{f.name}: a training setting; {run} does not use it (of the trainer "
                              "section only trainer.seed, which seeds a synthetic data.eval, is read)")
    for section, name, why in (("rollout", "staleness", "asynchronous training"),
                               ("eval", "save_answers", "a training run's held-out answers; the evaluation writes "
                                "every answer to evaluate.output"),
                               ("eval", "at_start", "a training run's evaluation of its starting policy; this run "
                                "evaluates model.hf_dir once"),
                               ("data", "train", "the training prompts; the evaluation answers data.eval"),
                               ("data", "eval_every", "the training run's evaluation interval; this run evaluates "
                                "once"),
                               ("data", "shuffle", "the order of the training prompts"),
                               ("logging", "plot", "the training curves' PNG; an evaluation has one step"),
                               ("workflow", "max_failure_steps", "the training steps in a row; one evaluation "
                                "stops when more than workflow.max_failure_fraction of its episodes fail")):
        got, want = getattr(getattr(cfg, section), name), getattr(getattr(default, section), name)
        if got != want:
            raise ConfigError(f"{section}.{name}={got!r}: {why}; {run} does not use it (default {want!r})")


def _unused(section: str, obj: Any, names: tuple[str, ...], why: str) -> None:
    """Refuse any of `names` set away from its default where it has no effect (`why`): a value that
    would be read by nothing must not look like it was applied."""
    default = type(obj)()
    for name in names:
        got, want = getattr(obj, name), getattr(default, name)
        if got != want:
            raise ConfigError(f"{section}.{name}={got!r} has no effect {why}; remove it (default {want!r})")


def _check_unused(cfg: Config) -> None:
    """Fields that act only in some modes, set in a mode where nothing reads them (an SFT / DPO run
    refuses every RL section it ignores: _check_offline)."""
    a, r, d, c, t = cfg.algorithm, cfg.rollout, cfg.data, cfg.cluster, cfg.trainer
    if a.advantage not in ("reinforce_pp", "gae"):
        _unused("algorithm", a, ("gamma",), f"with algorithm.advantage={a.advantage} (only reinforce_pp and gae "
                "discount rewards)")
    if a.advantage != "gae":
        _unused("algorithm", a, ("lam",), f"with algorithm.advantage={a.advantage} (GAE's lambda: advantage=gae)")
    if a.policy_loss != "dual_clip":
        _unused("algorithm", a, ("dual_clip_c",), f"with algorithm.policy_loss={a.policy_loss} (dual_clip's bound)")
    if a.kl_coef == 0:
        _unused("algorithm", a, ("kl_estimator", "kl_in_reward", "reference_hf_dir"),
                "with algorithm.kl_coef=0 (no KL term)")
    if a.rollout_is not in ("tis", "mis_token", "mis_seq"):
        _unused("algorithm", a, ("rollout_is_cap",), f"with algorithm.rollout_is={a.rollout_is} (the cap of "
                "tis / mis_token / mis_seq)")
    if a.rollout_is != "icepop":
        _unused("algorithm", a, ("icepop_low", "icepop_high"), f"with algorithm.rollout_is={a.rollout_is} (icepop's "
                "band)")
    if a.overlong_buffer == 0:
        _unused("algorithm", a, ("overlong_penalty",), "with algorithm.overlong_buffer=0 (no overlong shaping)")
    if not a.dynamic_sampling.enabled:
        _unused("algorithm.dynamic_sampling", a.dynamic_sampling, ("max_rounds",),
                "with algorithm.dynamic_sampling.enabled=false")
    if r.staleness == 0:
        _unused("rollout", r, ("stale_policy", "interrupt_on_sync"), "with rollout.staleness=0 (the synchronous "
                "loop syncs weights after the step's rollout has ended: no request is in flight or stale)")
    if t.optimizer != "adam":
        _unused("trainer", t, ("adam_beta1", "adam_beta2", "adam_eps"), f"with trainer.optimizer={t.optimizer}")
    judge = cfg.reward_model
    if c.gpus_per_node > 0 and c.nodes == 1:  # (several nodes may be Ray "GPU" slots of CPU machines: Slurm)
        why = "on GPUs (cluster.gpus_per_node > 0: vLLM sizes its KV cache by gpu_memory_utilization there)"
        _unused("rollout", r, ("cpu_kv_cache_gb",), why)
        if judge is not None:
            _unused("reward_model", judge, ("cpu_kv_cache_gb",), why)
    elif c.gpus_per_node == 0:
        why = "on CPU (cluster.gpus_per_node=0)"
        _unused("rollout", r, ("gpu_memory_utilization",), why)
        _unused("cluster", c, ("gpu_memory_gb",), why)
        if judge is not None:
            _unused("reward_model", judge, ("gpu_memory_utilization",), why)
    # vLLM's CPU build reads its KV cache size as whole GiB (VLLM_CPU_KVCACHE_SPACE, an int)
    for section, kv in (("rollout", r.cpu_kv_cache_gb), ("reward_model", judge.cpu_kv_cache_gb if judge else 1)):
        if kv < 1 or kv != int(kv):
            raise ConfigError(f"{section}.cpu_kv_cache_gb={kv}: expected a whole number of GiB >= 1 (vLLM's CPU "
                              "build reads VLLM_CPU_KVCACHE_SPACE as an integer)")
    if c.nodes == 1:
        _unused("cluster", c, ("ray_address", "join_timeout_s"), "with cluster.nodes=1 (no Ray cluster is joined: "
                "--nodes N for one)")
    else:
        _unused("rollout", r, ("host",), f"with cluster.nodes={c.nodes} (each engine listens on its node's address)")
    # (the built-in workflows: a custom one may read reward_timeout_s / reward_workers for a reward of its own)
    rewards = _rewards_in_use(cfg)
    if cfg.offline is None and cfg.workflow.name in ("rlvr", "multi_turn", "openai_agent") and \
            all(_inline_reward(name) for name in rewards):
        named = f"data.mix's rewards {', '.join(sorted(set(rewards)))}" if d.mix else f"workflow.reward={rewards[0]}"
        _unused("workflow", cfg.workflow, ("reward_timeout_s", "reward_workers"), f"with {named} (an inline reward: "
                "called in the driver, with no process pool and no timeout)")
    if cfg.weight_sync.transport != "disk":
        _unused("weight_sync", cfg.weight_sync, ("disk_dir",), f"with weight_sync.transport="
                f"{cfg.weight_sync.transport} (the disk transport's folder)")
    # data.eval_every and data.num_synthetic describe a recipe's own datasets and stay when a command
    # line swaps them (data.train=my.jsonl data.eval=null), as a recipe's critic section stays for gae
    if not d.held_out():
        _unused("eval", cfg.eval, ("samples_per_prompt", "correct_threshold", "save_answers", "at_start"),
                "without data.eval (no held-out evaluation)")
    elif d.eval_every == 0 and cfg.evaluate is None:  # (an evaluation run answers data.eval once)
        field = "data.eval" if d.eval is not None else f"data.mix[{[bool(x.eval) for x in d.mix].index(True)}].eval"
        raise ConfigError(f"{field}={d.describe('eval')} is never evaluated with data.eval_every=0: set "
                          f"data.eval_every to evaluate every N steps (and at the end; eval.at_start adds the "
                          f"starting policy, not instead of them), or remove {field}")


_SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]*[A-Za-z0-9][A-Za-z0-9_.-]*")


def _check_mix(cfg: Config) -> None:
    """data.mix: a prompt mixture for RL and evaluation runs, instead of data.train / data.eval."""
    d = cfg.data
    if not d.mix:
        return
    if cfg.offline is not None:
        kind = next(name for name in OFFLINE_KINDS if getattr(cfg, name) is not None)
        raise ConfigError(f"data.mix: a prompt mixture for RL and evaluation runs; a {kind} run reads data.train "
                          "(and data.eval)")
    if d.train != DataConfig().train:
        raise ConfigError(f"data.train={d.train}: set together with data.mix; a mixture names each source's "
                          "prompts (data.mix[i].train)")
    if d.eval is not None:
        raise ConfigError(f"data.eval={d.eval}: set together with data.mix; a mixture names each source's held-out "
                          "prompts (data.mix[i].eval)")
    evaluation = cfg.evaluate is not None
    if cfg.workflow.reward == "reward_model" or any(s.reward == "reward_model" for s in d.mix):
        raise ConfigError("workflow.reward=reward_model with data.mix: the served judge scores every row of one "
                          "dataset; a mixture's sources keep rewards of their own (data.mix[i].reward)")
    from mlrl.data.registry import default_reward, source_reward
    from mlrl.reward.registry import list_rewards

    for i, s in enumerate(d.mix):
        for name in ("eval", "reward"):
            if getattr(s, name) is not None and not str(getattr(s, name)).strip():
                raise ConfigError(f"data.mix[{i}].{name}: empty; expected a {'dataset' if name == 'eval' else 'reward'}"
                                  " name or path, or leave it out")
        if s.reward and s.reward not in list_rewards() and "." not in s.reward and ":" not in s.reward:
            raise ConfigError(f"data.mix[{i}].reward={s.reward}: unknown reward; registered: "
                              f"{', '.join(list_rewards())} (or a dotted path pkg.module.fn)")
        train, held = default_reward(s.train or ""), default_reward(s.eval or "")
        if not s.reward and train and held and train != held:
            raise ConfigError(f"data.mix[{i}].reward: not set, and the source's train data ({s.train}) is made for "
                              f"the {train} reward while its eval data ({s.eval}) is made for {held}; one reward "
                              "scores a source: name it")
    own = [source_reward(s) for s in d.mix]
    if all(own) and cfg.workflow.reward != WorkflowConfig().reward:
        raise ConfigError(f"workflow.reward={cfg.workflow.reward}: every data.mix source has a reward of its own ("
                          + ", ".join(f"{s.name}: {r}" for s, r in zip(d.mix, own)) + "), so it scores none of them; "
                          "remove it (or name it as a source's data.mix[i].reward)")
    trained = [i for i, s in enumerate(d.mix) if s.train]  # (an RL run's eval-only sources have no share)
    if not evaluation and not trained and all(s.eval for s in d.mix):
        raise ConfigError("data.mix: every source is held-out only (eval, no train); an RL run trains on at least "
                          "one source's prompts (data.mix[i].train)")
    weighted = [i for i in trained if d.mix[i].weight is not None]
    if not evaluation and weighted and len(weighted) < len(trained):
        unset = next(i for i in trained if d.mix[i].weight is None)
        raise ConfigError(f"data.mix[{unset}].weight: not set while data.mix[{weighted[0]}].weight is; set a weight "
                          "on every source with train prompts (shares of each epoch) or on none (each source's rows "
                          "once per epoch)")
    seen: set[str] = set()
    for i, s in enumerate(d.mix):
        at = f"data.mix[{i}]"
        if not _SOURCE_NAME.fullmatch(s.name):
            raise ConfigError(f"{at}.name={s.name!r}: expected a label of letters, digits, '_', '-' or '.', with a "
                              "letter or digit (the rows' data_source and the prefix of the source's metrics)")
        if s.name in seen:
            raise ConfigError(f"{at}.name={s.name!r}: two sources with one name; each needs its own (its metrics' "
                              "prefix)")
        seen.add(s.name)
        if evaluation:
            if s.train:
                raise ConfigError(f"{at}.train={s.train}: the training prompts; an evaluation (evaluate: section) "
                                  "answers each source's eval")
            if s.weight is not None:
                raise ConfigError(f"{at}.weight={s.weight}: a share of the training prompts; an evaluation answers "
                                  "every held-out prompt of every source")
            if not s.eval:
                raise ConfigError(f"{at}.eval: not set; an evaluation answers each source's held-out prompts "
                                  "(a file, a registered name or synthetic:<task>)")
            continue
        if not s.train:
            if not s.eval:
                raise ConfigError(f"{at}.train: not set; a source names its training prompts (a file, a registered "
                                  "name, synthetic:<task> or pkg.module:loader), its held-out prompts (eval) or both")
            if s.weight is not None:
                raise ConfigError(f"{at}.weight={s.weight}: a share of the training prompts, and source {s.name!r} "
                                  "has none (eval only: its held-out prompts are evaluated, never trained on)")
            continue
        if s.weight is not None and not (math.isfinite(s.weight) and s.weight > 0):
            raise ConfigError(f"{at}.weight={s.weight}: expected a number > 0 (the source's share of the prompts)")


def _rewards_in_use(cfg: Config) -> list[str]:
    """workflow.reward, or with data.mix each source's reward (mlrl.data.registry.mix_rewards)."""
    if not cfg.data.mix:
        return [cfg.workflow.reward]
    from mlrl.data.registry import mix_rewards

    return list(mix_rewards(cfg.data, cfg.workflow.reward).values())


def _inline_reward(name: Any) -> bool:
    """A registered reward declared inline (mlrl.reward.register_reward(inline=True): exact_match,
    token_match); a dotted path is not imported here."""
    from mlrl.reward.registry import get_reward_fn, is_inline, list_rewards

    return isinstance(name, str) and name in list_rewards() and is_inline(get_reward_fn(name))


def _check_mode(cfg: Config) -> None:
    eta = cfg.rollout.staleness
    if eta > 0 and cfg.algorithm.rollout_is == "none":
        raise ConfigError(
            f"rollout.staleness={eta} needs importance-sampling correction: set algorithm.rollout_is to tis, "
            "mis_token or mis_seq"
        )


def resolve_layout(cfg: Config) -> Layout:
    p, c = cfg.parallel, cfg.cluster
    total = c.nodes * c.gpus_per_node
    # an SFT / DPO run starts no engines
    rollout_devices = cfg.rollout.num_engines * cfg.rollout.engine_tp if c.gpus_per_node and cfg.offline is None else 0
    if c.gpus_per_node and cfg.reward_model is not None and cfg.offline is None:  # the judge's engines
        rollout_devices += cfg.reward_model.num_engines * cfg.reward_model.engine_tp
    model_par = p.tp * p.pp * p.cp
    devices = c.trainer_devices
    if cfg.evaluate is not None:  # the engines alone (validation refuses cluster.trainer_devices)
        if total and rollout_devices > total:
            raise ConfigError(f"cluster: {c.nodes} node(s) x {c.gpus_per_node} GPUs cannot host the evaluation's "
                              f"engines: rollout.num_engines x rollout.engine_tp"
                              f"{' + the judge' if cfg.reward_model is not None else ''} = {rollout_devices} GPUs")
        return Layout(p.tp, p.pp, p.cp, p.ep, p.etp if p.etp is not None else p.tp, 0, p.vpp, 0, rollout_devices,
                      total)
    if devices is not None:
        source = "cluster.trainer_devices"
    elif c.gpus_per_node == 0:
        devices, source = model_par, "on CPU: tp*pp*cp"
    elif c.placement == "colocated":
        devices, source = total, "colocated: all GPUs"
    else:
        devices, source = total - rollout_devices, "disaggregated: the GPUs left after the engines"
        judge = " + reward_model.num_engines x reward_model.engine_tp" if cfg.reward_model is not None else ""
        if devices <= 0:
            raise ConfigError(
                f"cluster: {c.nodes} node(s) x {c.gpus_per_node} GPUs = {total} GPUs leave none for the trainer after "
                f"rollout.num_engines x rollout.engine_tp{judge} = {rollout_devices} engine GPUs (disaggregated "
                "placement)")
    if devices % model_par:
        raise ConfigError(f"parallel: tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {model_par} does not divide the trainer's "
                          f"{devices} devices ({source}); the data-parallel size is cluster.trainer_devices / "
                          f"(tp*pp*cp): set cluster.trainer_devices to a multiple of {model_par}")
    dp = devices // model_par
    etp = p.etp if p.etp is not None else p.tp
    if total:
        if c.placement == "disaggregated" and devices + rollout_devices > total:
            raise ConfigError(
                f"cluster: trainer {devices} + engines {rollout_devices} GPUs exceed {c.nodes} x {c.gpus_per_node} = "
                f"{total} GPUs"
            )
        if c.placement == "colocated" and max(devices, rollout_devices) > total:
            raise ConfigError(
                f"cluster: colocated trainer/engines need {max(devices, rollout_devices)} GPUs, the cluster has {total}"
            )
    return Layout(p.tp, p.pp, p.cp, p.ep, etp, dp, p.vpp, devices, rollout_devices, total)


def _check_devices(cfg: Config, cuda: Callable[[], bool]) -> None:
    p, t, c = cfg.parallel, cfg.trainer, cfg.cluster
    gpu_run = c.gpus_per_node > 0
    if t.fp8_recipe != "none" and not gpu_run:
        raise ConfigError(
            f"trainer.fp8_recipe={t.fp8_recipe!r} needs GPUs with Transformer Engine (cluster.gpus_per_node is 0: a "
            "CPU run)"
        )
    if p.cp > 1 and not gpu_run:
        raise ConfigError(
            f"parallel.cp={p.cp}: context parallel needs GPUs (Transformer Engine attention); cluster.gpus_per_node "
            "is 0"
        )
    if gpu_run and c.nodes == 1 and not cuda():
        raise ConfigError(
            f"cluster.gpus_per_node={c.gpus_per_node} but this machine has no CUDA device (use --dry-run to plan, or "
            "gpus_per_node=0)"
        )
    if t.deterministic is False and not gpu_run:
        raise ConfigError("trainer.deterministic=false: the CPU trainer is always deterministic (gloo, fixed-order "
                          "reductions), so there is nothing to turn off; use auto or true (false pays off on GPU)")
    if p.vpp is not None and p.vpp > 1 and not gpu_run:
        raise ConfigError(
            f"parallel.vpp={p.vpp}: the interleaved pipeline schedule hangs on gloo; virtual pipeline stages are GPU "
            "only"
        )
    if p.sequence_parallel and p.tp < 2:
        raise ConfigError("parallel.sequence_parallel needs parallel.tp >= 2")
    if c.nodes > 1 and not gpu_run:
        raise ConfigError(f"cluster.nodes={c.nodes} needs cluster.gpus_per_node >= 1 (multi-node runs are GPU runs)")
    if cfg.model.dtype == "float16" and not gpu_run:
        raise ConfigError("model.dtype=float16 (trainer precision fp16) is GPU only; use float32 (or bfloat16) on CPU")
    if cfg.checkpoint.async_save and not gpu_run:
        raise ConfigError("checkpoint.async_save needs GPUs (megatron-core's async writer); set it false on CPU")
    if cfg.weight_sync.transport == "cuda_ipc" and (not gpu_run or c.placement != "colocated"):
        raise ConfigError("weight_sync.transport=cuda_ipc needs GPUs and cluster.placement=colocated")
    if cfg.weight_sync.transport == "cuda_ipc" and c.nodes > 1:
        raise ConfigError(
            f"weight_sync.transport=cuda_ipc shares the trainer's GPU memory with engines on the same machine; "
            f"cluster.nodes={c.nodes} puts engines on other nodes: use weight_sync.transport=disk"
        )


def _check_router_replay(cfg: Config, hf: dict[str, Any], *, has_cuda: bool) -> None:
    if not cfg.algorithm.router_replay:
        return
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if not experts:
        raise ConfigError(f"algorithm.router_replay=true needs an MoE model; model.hf_dir ({cfg.model.hf_dir}, "
                          f"model_type={hf.get('model_type')!r}) has no experts")
    if cfg.offline is not None:
        raise ConfigError(f"algorithm.router_replay=true: {_RUN_NAMES[cfg.offline]} has no rollout engines to "
                          "replay")
    if cfg.parallel.cp > 1:
        raise ConfigError(f"algorithm.router_replay=true with parallel.cp={cfg.parallel.cp}: replaying routes "
                          "into context-parallel slices is not implemented (use cp=1)")
    if cfg.trainer.recompute == "full":
        # the routers return to their own routing after each micro-batch's forward (RouterControl.after_forward),
        # before its backward: a full recompute there would route by the trainer, and the gradients would go
        # through other experts than the loss (with pp > 1, through another micro-batch's routes)
        raise ConfigError("algorithm.router_replay=true with trainer.recompute=full: the recomputed forward in the "
                          "backward pass would not replay the engine's routes; use recompute=selective or none")
    problem = routing_capture_problem(gpu=has_cuda, lora_adapter=cfg.model.lora is not None
                              and cfg.weight_sync.lora_mode == "adapter")
    if problem:
        raise ConfigError(f"algorithm.router_replay=true: {problem}")


def _check_shared_prefix(cfg: Config) -> None:
    """trainer.shared_prefix_packing needs attention that lets a response attend to a prompt packed
    elsewhere in the row: mlrl's CPU local attention (trainer/rank/local_spec.py) does; Transformer
    Engine's THD attention (GPU) has no such mask."""
    if cfg.trainer.shared_prefix_packing != "always":
        return  # never, or auto: resolved by Config.uses_shared_prefix_packing
    if cfg.cluster.gpus_per_node > 0:
        raise ConfigError(f"trainer.shared_prefix_packing=always with cluster.gpus_per_node="
                          f"{cfg.cluster.gpus_per_node}: shared-prefix attention is implemented by the CPU "
                          "trainer's local attention only (Transformer Engine's packed THD attention has no "
                          "shared-prefix mask); use never or auto")
    if cfg.algorithm.router_replay:
        raise ConfigError("trainer.shared_prefix_packing=always with algorithm.router_replay=true: replayed routes are "
                          "laid out per sample, not per shared prompt; use never or auto")


TE_INSTALL_HINT = ("pip install --no-build-isolation 'transformer_engine[pytorch]==2.20.2' (README: GPU install); "
                   "megatron-core's GPU layer spec, FP8 and context parallelism need it")


def transformer_engine_installed() -> bool:
    """Transformer Engine importable here (found, not imported: importing it costs seconds). The
    launcher's check and each trainer rank's (mlrl.trainer.rank.numerics) use this one."""
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def _check_transformer_engine(cfg: Config, has_te: bool) -> None:
    """A GPU run on this machine: the trainer ranks build Megatron's Transformer Engine layer spec
    (mlrl.trainer.rank.model.use_te), so TE must be importable here before any rank starts."""
    if not has_te:
        raise ConfigError(f"cluster.gpus_per_node={cfg.cluster.gpus_per_node}: this machine has CUDA but not "
                          f"Transformer Engine (no module transformer_engine); {TE_INSTALL_HINT}")


def validate(cfg: Config, *, has_cuda: bool | None = None, has_te: bool | None = None,
             dry_run: bool = False) -> Layout:
    """Check everything that can be checked before start; return the resolved layout.

    `dry_run=True` plans a cluster from anywhere: a missing model folder falls back to
    `model.arch` and the local machine's lack of CUDA is not an error. `has_cuda` / `has_te`
    describe the machine (default: detected; a caller that states `has_cuda` describes another
    machine, and that machine has Transformer Engine unless `has_te` says otherwise).
    """
    if has_te is None:
        has_te = True if has_cuda is not None else None
    if has_cuda is None:
        # Probed only where a check needs it (a GPU config, the megatron-bridge path): the probe imports
        # torch (~1.2 s), and a CPU run's engines start right after validation. A dry run never needs
        # the local GPU.
        cuda: Callable[[], bool] = functools.cache(lambda: dry_run or _cuda_available())
    else:
        cuda = functools.partial(bool, has_cuda)
    _check_ranges(cfg)
    _check_evaluate(cfg)  # (first: evaluate together with an offline section is named as such)
    _check_offline(cfg)
    _check_unused(cfg)
    _check_mix(cfg)
    _check_reward_model(cfg)
    _check_critic(cfg)
    _check_lora(cfg)
    _check_mode(cfg)
    _check_colocate(cfg)
    _check_devices(cfg, cuda=lambda: dry_run or cuda())
    if cfg.cluster.gpus_per_node > 0 and (dry_run or cuda()):  # (Ray tests simulate GPUs on CPU: gloo, no NCCL)
        _check_colocate_transport(cfg)
    # (an evaluation starts no trainer: vLLM alone needs no Transformer Engine)
    if cfg.cluster.gpus_per_node > 0 and cfg.cluster.nodes == 1 and not dry_run and cfg.evaluate is None and cuda():
        _check_transformer_engine(cfg, transformer_engine_installed() if has_te is None else has_te)
    layout = resolve_layout(cfg)
    try:
        hf = hf_config_dict(cfg.model.hf_dir, cfg.model.arch if dry_run else None)
    except ModelSpecError as e:
        raise ConfigError(str(e)) from None
    check_arch_preset(cfg.model.arch, hf)
    # (an evaluation starts no trainer: any model vLLM serves, whatever the bridge supports)
    which = check_bridge(cfg, hf, cuda=cuda, dry_run=dry_run) if cfg.evaluate is None else None
    check_model(cfg, hf, layout, trainer=cfg.evaluate is None)
    if which == "builtin":
        check_arch(hf, layout, cfg.parallel.pp_layer_split)
    _check_lora(cfg, hf)
    _check_router_replay(cfg, hf, has_cuda=cfg.cluster.gpus_per_node > 0)
    _check_shared_prefix(cfg)
    if cfg.reward_model is not None and cfg.reward_model.hf_dir and not dry_run:  # the judge's folder (read at start)
        try:
            hf_config_dict(cfg.reward_model.hf_dir, None, field="reward_model.hf_dir")
        except ModelSpecError as e:
            raise ConfigError(str(e)) from None
    if cfg.uses_critic and cfg.critic is not None and cfg.critic.hf_dir:
        crit = _second_model(cfg, layout, cfg.critic.hf_dir, "critic.hf_dir")
        # a reward model's export: its body and its score head start the critic (the score head its value head)
        if is_sequence_classifier(crit) and classifier_labels(crit) != 1:
            raise ConfigError(f"critic.hf_dir: a {crit['architectures'][0]} with {classifier_labels(crit)} labels; the "
                              "critic's value head is one scalar (a one-label reward model, e.g. an rm run's export)")
        if crit.get("vocab_size") != hf.get("vocab_size"):
            raise ConfigError(f"critic.hf_dir: vocab_size {crit.get('vocab_size')} differs from the policy's "
                              f"{hf.get('vocab_size')} (model.hf_dir): the critic must read the policy's tokens")
    if cfg.algorithm.reference_hf_dir and cfg.algorithm.kl_coef > 0:  # (kl_coef=0: refused as unread)
        if cfg.algorithm.router_replay:
            raise ConfigError("algorithm.reference_hf_dir with algorithm.router_replay=true: the engines' routes are "
                              "the policy's experts, not the reference model's; use one or the other")
        ref = _second_model(cfg, layout, cfg.algorithm.reference_hf_dir, "algorithm.reference_hf_dir")
        if is_sequence_classifier(ref):
            raise ConfigError(f"algorithm.reference_hf_dir: a {ref['architectures'][0]} (a reward model: a score head, "
                              "no LM head) gives no token log-probabilities; name a causal LM")
        # a padded embedding may be larger (Qwen2.5-7B's 152064 rows, 1.5B's 151936, one tokenizer: the
        # launcher compares the tokenizers); smaller, a token the policy samples may have no row
        if (ref.get("vocab_size") or 0) < (hf.get("vocab_size") or 0):
            raise ConfigError(f"algorithm.reference_hf_dir: vocab_size {ref.get('vocab_size')} is smaller than the "
                              f"policy's {hf.get('vocab_size')} (model.hf_dir): the reference must score every token "
                              "the policy can sample")
    return layout


def _second_model(cfg: Config, layout: Layout, spec: str, field: str) -> dict[str, Any]:
    """A model the trainer ranks build beside the policy from another folder (the critic's body, a
    KL reference / teacher), not served by the engines: readable, in the policy's parallel layout.
    Its config.json."""
    try:
        other = hf_config_dict(spec, None, field=field)
    except ModelSpecError as e:
        raise ConfigError(str(e)) from None
    try:
        check_model(cfg, other, layout, engines=False)
        check_arch(other, layout, cfg.parallel.pp_layer_split)
    except ConfigError as e:
        raise ConfigError(f"{field}: {e}") from None
    return other


def check_driver(cfg: Config) -> None:
    """What only the launching process needs, checked there before start-up (`validate` also runs in
    every trainer rank, which needs none of it): W&B installed for logging.wandb_project (else the
    run failed at its first metrics line, after the engines, the ranks and the first sync)."""
    import importlib.util

    if cfg.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"logging.wandb_project={cfg.logging.wandb_project!r}: Weights & Biases is not "
                          "installed here; pip install mlrl[wandb] (or pip install wandb), or unset it")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()

"""`make_plan(cfg, layout)`: placement, parallel layout and per-GPU memory for any cluster size.

Runs anywhere (no GPU, no cluster, no weights): the model's sizes come from its config.json or a
preset (`model.arch`). The plan is what `--dry-run` prints and what `mlrl.cluster` turns into Ray
placement groups, so both agree on which GPU does what. Memory formulas and their sources are in
`mlrl.plan.memory`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from mlrl.config.schema import Config
from mlrl.config.validate import Layout, check_micro_batch_budget
from mlrl.modelzoo import hf_config_dict
from mlrl.plan import memory as mem
from mlrl.plan.model import ModelShape, model_shape
from mlrl.plan.placement import GpuSlot, TrainerRank, expert_dp, place, tp_groups_spanning_nodes, trainer_rank


@dataclass
class Plan:
    cfg: Config
    layout: Layout
    shape: ModelShape
    cpu: bool                                    # gpus_per_node == 0: processes share the cores
    slots: list[GpuSlot]                         # one per GPU, node-major (empty on CPU)
    stage_layers: list[list[int]]                # layer indices per pipeline rank
    stage_params: list[mem.StageParams]          # per pipeline rank, elements per trainer GPU
    trainer_memory: list[mem.TrainerMemory]      # per pipeline rank
    engine_memory: mem.EngineMemory | None
    gpu_bytes: list[float]                       # peak bytes per slot (same order as slots)
    micro_batches: int                           # per DP rank and optimizer step
    seq_len: int                                 # max prompt + response tokens
    capacity: float                              # cluster.gpu_memory_gb in bytes
    reasons: list[str] = field(default_factory=list)   # why it does not fit (empty = fits)
    warnings: list[str] = field(default_factory=list)
    critic_params: list[mem.StageParams] | None = None  # per pipeline rank, the critic's (None = no critic)
    sync_buffers: list[mem.SyncBuffers] = field(default_factory=list)  # per pipeline rank (colocated GPU runs)
    samples: int = 0                             # sequences per optimizer step
    num_engines: int = 0                         # rollout engines (0: an SFT / DPO run starts none)
    judge_engines: int = 0                       # reward_model's engines: placed after the rollout engines

    @property
    def fits(self) -> bool:
        return not self.reasons

    @property
    def experts_per_rank(self) -> int:
        return self.shape.experts // self.layout.ep if self.shape.experts else 0

    @property
    def expert_dp(self) -> int:
        return expert_dp(self.layout)

    def trainer_ranks(self) -> list[TrainerRank]:
        return [trainer_rank(r, self.layout) for r in range(self.layout.trainer_devices)]

    @property
    def colocated(self) -> bool:
        return self.cfg.cluster.placement == "colocated" and self.engine_memory is not None

    def colocated_phases(self, pp: int, sender: bool = True) -> mem.ColocatedPhases:
        """The step's phases on a GPU shared by an engine rank and a trainer rank of pipeline
        stage `pp` (`sender`: the stage's weight-sync sender, tp 0, dp 0, cp 0)."""
        co = self.cfg.cluster.colocate
        if self.engine_memory is None:
            raise ValueError("colocated_phases: this plan has no engine memory (no colocated engines)")
        return mem.colocated_phases(self.trainer_memory[pp], self.engine_memory, offload_params=co.offload_params,
                                    sleep_level=co.sleep_level, sync=self.sync_buffers[pp], sender=sender)

    def slot_phases(self, slot: GpuSlot) -> mem.ColocatedPhases | None:
        """The phases of a GPU holding both a trainer rank and an engine rank (None otherwise)."""
        if not (self.colocated and slot.trainer and slot.engine):
            return None
        return self.colocated_phases(slot.trainer.pp, _is_sender(slot.trainer))

    def host_bytes_per_node(self) -> list[dict[str, float]]:
        """Per node, per phase name: host memory holding what its colocated GPUs offloaded."""
        out = [{} for _ in range(self.cfg.cluster.nodes)]
        for slot in self.slots:
            for ph in self.slot_phases(slot) or ():
                out[slot.node][ph.name] = out[slot.node].get(ph.name, 0.0) + ph.host_total
        return out


def make_plan(cfg: Config, layout: Layout) -> Plan:
    hf = hf_config_dict(cfg.model.hf_dir, cfg.model.arch)
    shape = model_shape(hf, cfg.model.arch or cfg.model.hf_dir)
    c, t, r, p = cfg.cluster, cfg.trainer, cfg.rollout, cfg.parallel
    cpu = c.gpus_per_node == 0
    offline = cfg.offline_section  # SFT / DPO / RM: the trainer alone on a fixed dataset
    seq_len, samples = _step_shape(cfg)
    micro = max(1, math.ceil(samples * seq_len / layout.dp / t.token_budget))
    layers = mem.stage_layers(shape.layers, layout.pp, layout.vpp, p.pp_layer_split)
    lora = cfg.model.lora  # the policy's adapters; the critic trains its full weights
    scalar = cfg.rm is not None  # a reward model: a scalar head in place of the LM head (no vocabulary logits)
    params = [mem.stage_params(shape, ls, first=k == 0, last=k == layout.pp - 1, pp=layout.pp, tp=layout.tp,
                               ep=layout.ep, etp=layout.etp, lora=lora, value_head=scalar)
              for k, ls in enumerate(layers)]
    critic, chf, cshape, clayers = None, None, shape, layers
    if cfg.uses_critic:  # the critic's own model when critic.hf_dir names one (validation: same vocabulary)
        chf = cfg.critic.hf_dir if cfg.critic is not None else None
        cshape = model_shape(hf_config_dict(chf, None, field="critic.hf_dir"), chf) if chf else shape
        clayers = layers if chf is None else mem.stage_layers(cshape.layers, layout.pp, layout.vpp, p.pp_layer_split)
        critic = [mem.stage_params(cshape, ls, first=k == 0, last=k == layout.pp - 1, pp=layout.pp, tp=layout.tp,
                                   ep=layout.ep, etp=layout.etp, value_head=True) for k, ls in enumerate(clayers)]
    teacher = None
    if cfg.algorithm.reference_hf_dir and cfg.algorithm.kl_coef > 0:  # a KL reference of its own (same vocabulary)
        rhf = cfg.algorithm.reference_hf_dir
        rshape = model_shape(hf_config_dict(rhf, None, field="algorithm.reference_hf_dir"), rhf)
        teacher = [mem.stage_params(rshape, ls, first=k == 0, last=k == layout.pp - 1, pp=layout.pp, tp=layout.tp,
                                    ep=layout.ep, etp=layout.etp)
                   for k, ls in enumerate(mem.stage_layers(rshape.layers, layout.pp, layout.vpp, p.pp_layer_split))]
    precision = cfg.model.precision  # the trainer's, derived from model.dtype
    act_bytes = 4 if precision == "fp32" else 2
    tokens = t.token_budget / layout.cp
    tmem = []
    for k, ls in enumerate(layers):
        stage_acts = functools.partial(
            mem.stage_activation_bytes, tokens=tokens,
            inflight=mem.inflight_microbatches(k, layout.pp, layout.vpp, micro), act_bytes=act_bytes,
            tp=layout.tp, etp=layout.etp, sp=p.sequence_parallel, flash=not cpu, recompute=t.recompute,
            seq_len=min(seq_len, t.token_budget))
        acts = stage_acts(shape, ls, last=k == layout.pp - 1 and not scalar, lora=lora)
        if chf:  # a critic of its own model may be the larger pass (no vocabulary logits: last=False)
            acts = max(acts, stage_acts(cshape, clayers[k], last=False, lora=None))
        tmem.append(mem.trainer_memory(
            params[k], precision=precision, optimizer=t.optimizer, distributed_optimizer=t.use_distributed_optimizer,
            dp_cp=layout.dp * layout.cp, edp=expert_dp(layout), fp8=t.fp8_recipe != "none",
            reference=(cfg.algorithm.kl_coef > 0 or cfg.dpo is not None), activations=acts,
            critic=critic[k] if critic else None, teacher=teacher[k] if teacher else None))
    plan = Plan(cfg, layout, shape, cpu, [], layers, params, tmem, None, [], micro, seq_len, c.gpu_memory_gb * mem.GIB,
                critic_params=critic, samples=samples, num_engines=0 if offline is not None else r.num_engines,
                judge_engines=cfg.reward_model.num_engines if cfg.reward_model is not None and offline is None else 0)
    if offline is None and seq_len > t.token_budget:
        plan.warnings.append(
            f"a full-length sample ({seq_len} tokens = data.max_prompt_tokens + rollout.sampling.max_new_tokens) "
            f"exceeds trainer.micro_batch_tokens={t.token_budget}")
    if cpu:
        return plan
    if offline is not None:  # no engines: every GPU of the plan is a trainer rank's
        plan.slots, problems = place(layout, c.nodes, c.gpus_per_node, 0, 1, False)
        plan.reasons.extend(problems)
        plan.warnings.extend(tp_groups_spanning_nodes(layout, c.gpus_per_node))
        _check_memory(plan)
        return plan
    max_len = r.max_model_len or shape.max_positions or seq_len
    plan.engine_memory = mem.engine_memory(
        shape, engine_tp=r.engine_tp, dtype_bytes=mem.DTYPE_BYTES[cfg.model.dtype], gpu_bytes=plan.capacity,
        utilization=r.gpu_memory_utilization, max_model_len=max_len, enforce_eager=r.enforce_eager,
        lora_rank=_engine_lora_rank(cfg))
    plan.sync_buffers = _sync_buffers(cfg, shape, layers)
    plan.slots, problems = place(  # the judge's engines (reward_model) take the slots after the policy's
        layout, c.nodes, c.gpus_per_node, r.num_engines + plan.judge_engines, r.engine_tp, c.placement == "colocated"
    )
    plan.reasons.extend(problems)
    plan.warnings.extend(tp_groups_spanning_nodes(layout, c.gpus_per_node))
    _check_memory(plan)
    return plan


CPU_MICRO_BATCH_TOKENS = 4096   # trainer.micro_batch_tokens=auto on CPU (host memory is not planned)
AUTO_MEMORY_FRACTION = 0.85     # of cluster.gpu_memory_gb that auto fills with the estimate: the allocator's
#                                 fragmentation and what the estimate leaves out (the H200's qwen3-1.7b
#                                 bench step, 16 x 2048 tokens in 4 micro-batches: estimate 54.5 GB,
#                                 measured peak 52.6 GB)
AUTO_TOKEN_STEP = 256


def _step_shape(cfg: Config) -> tuple[int, int]:
    """(longest sequence, sequences per optimizer step) of the run."""
    offline = cfg.offline_section
    if offline is not None:  # DPO / RM: both sides of a pair
        return offline.max_seq_tokens, offline.batch_size * (2 if cfg.trains_on_pairs else 1)
    t = cfg.trainer
    return (cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens,
            t.prompts_per_step * t.samples_per_prompt // t.mini_batches_per_step)


def trainer_train_bytes(plan: Plan) -> float:
    """The fullest trainer GPU of the plan in its training phase: what grows with the micro-batch
    (a colocated GPU's rollout and sync phases do not depend on it; whether they fit is the
    plan's own verdict)."""
    out = 0.0
    for slot, used in zip(plan.slots, plan.gpu_bytes):
        if slot.trainer is None:
            continue
        phases = plan.slot_phases(slot)
        out = max(out, phases.train.total if phases is not None else used)
    return out


def auto_micro_batch_tokens(cfg: Config, layout: Layout, device_gb: float | None = None) -> int:
    """trainer.micro_batch_tokens for `auto` (its docstring). The floor is one whole sequence (a
    DPO pair; an RL trajectory up to rollout.max_model_len when that is longer than prompt + new
    tokens: a multi-turn one can be). On GPU: the largest multiple of AUTO_TOKEN_STEP from the floor
    up to a DP rank's step (with pp > 1 at most a pp-th of it, so every rank runs >= pp
    micro-batches unless the floor is larger) whose plan keeps every trainer GPU's training phase
    within AUTO_MEMORY_FRACTION of the GPU's memory (cluster.gpu_memory_gb, or `device_gb`, the
    local device's, when smaller). When even the floor does not fit, the floor: the plan then says
    what does not fit (--dry-run, the cluster launcher). On CPU: CPU_MICRO_BATCH_TOKENS or the
    floor, the larger."""
    seq_len, samples = _step_shape(cfg)
    longest = seq_len
    if cfg.offline is None and cfg.rollout.max_model_len:
        longest = max(longest, cfg.rollout.max_model_len)
    whole = 2 * longest if cfg.trains_on_pairs else longest  # a DPO / RM pair shares its micro-batch

    def up(n: float) -> int:
        return max(AUTO_TOKEN_STEP, math.ceil(n / AUTO_TOKEN_STEP) * AUTO_TOKEN_STEP)

    lo = up(whole)
    if cfg.cluster.gpus_per_node == 0:
        return max(CPU_MICRO_BATCH_TOKENS, lo)
    per_rank = samples * seq_len / layout.dp
    if layout.pp > 1:  # at least pp micro-batches per rank: round down
        hi = max(lo, math.floor(per_rank / layout.pp / AUTO_TOKEN_STEP) * AUTO_TOKEN_STEP)
    else:  # a rank's whole step in one micro-batch at most
        hi = max(lo, up(per_rank))
    gb = cfg.cluster.gpu_memory_gb if device_gb is None else min(cfg.cluster.gpu_memory_gb, device_gb)
    budget = AUTO_MEMORY_FRACTION * gb * mem.GIB

    def fits(n: int) -> bool:
        trial = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, micro_batch_tokens=n))
        return trainer_train_bytes(make_plan(trial, layout)) <= budget

    if not fits(lo):
        return lo
    a, b = lo // AUTO_TOKEN_STEP, hi // AUTO_TOKEN_STEP  # fits(a * step); the estimate grows with the budget
    while a < b:
        m = (a + b + 1) // 2
        if fits(m * AUTO_TOKEN_STEP):
            a = m
        else:
            b = m - 1
    return a * AUTO_TOKEN_STEP


def resolve_micro_batch_tokens(cfg: Config, layout: Layout, device_gb: float | None = None) -> None:
    """trainer.micro_batch_tokens=auto -> its number, in place, right after validate() (mlrl.launch,
    which passes the local GPU's memory as `device_gb` on a one-machine GPU run), so --print-config,
    --dry-run and the ranks' config all carry the number."""
    if cfg.trainer.micro_batch_tokens != "auto":
        return
    cfg.trainer.micro_batch_tokens = auto_micro_batch_tokens(cfg, layout, device_gb)
    check_micro_batch_budget(cfg)


def _engine_lora_rank(cfg: Config) -> int:
    """The engines' --max-lora-rank (0: they serve merged weights, no --enable-lora)."""
    if cfg.model.lora is None or cfg.weight_sync.lora_mode != "adapter":
        return 0
    from mlrl.rollout.server import vllm_lora_rank  # imported only here: mlrl.rollout pulls in the HTTP clients

    return vllm_lora_rank(cfg.model.lora.rank)  # validation keeps the rank within vLLM's


def _sync_buffers(cfg: Config, shape: ModelShape, layers: list[list[int]]) -> list[mem.SyncBuffers]:
    """Per pipeline stage, the weight-sync transport's buffers (what the sync phase of a colocated
    GPU adds; mlrl.plan.memory's docstring has the terms)."""
    ws, wire = cfg.weight_sync, mem.DTYPE_BYTES[cfg.model.dtype]
    pp = len(layers)
    out = []
    for k, ls in enumerate(layers):
        full = 0.0
        if ws.transport == "cuda_ipc":  # the stage's whole weights, gathered over TP and EP
            full = mem.stage_params(shape, ls, first=k == 0, last=k == pp - 1, pp=pp, tp=1, ep=1, etp=1).total * wire
        out.append(mem.sync_buffers(
            ws.transport, bucket_bytes=ws.bucket_mb * 2**20, largest=mem.largest_tensor_params(shape) * wire,
            big_tensors=1 if shape.tied else 2, stage_weights=full,
            adapters_only=cfg.model.lora is not None and ws.lora_mode == "adapter"))
    return out


def _is_sender(r: TrainerRank) -> bool:
    """The rank of a pipeline stage that sends its weights to the engines (mlrl.trainer.rank.parallel)."""
    return r.tp == 0 and r.dp == 0 and r.cp == 0


def _slot_bytes(plan: Plan, slot: GpuSlot) -> float:
    e = plan.engine_memory
    phases = plan.slot_phases(slot)
    if phases is not None:
        return phases.peak.total
    if slot.trainer:
        return plan.trainer_memory[slot.trainer.pp].total
    if slot.engine and e is not None:
        return e.budget
    return 0.0


def _check_memory(plan: Plan) -> None:
    plan.gpu_bytes = [_slot_bytes(plan, s) for s in plan.slots]
    gib, cap = mem.GIB, plan.capacity
    seen: set[tuple] = set()
    for slot, used in zip(plan.slots, plan.gpu_bytes):
        if used <= cap:
            continue
        if slot.trainer is not None:
            key = ("trainer", slot.trainer.pp, slot.engine is not None)
            role = f"trainer rank {slot.trainer.rank} (pp stage {slot.trainer.pp})"
            m = plan.trainer_memory[slot.trainer.pp]
            parts = {k: v for k, v in m.parts().items() if k != "critic"}
            big = max(parts, key=lambda k: parts[k])
            detail = f"largest part: {big} {parts[big] / gib:.1f} GiB"
            if m.critic is not None:
                detail += f"; the critic adds {m.critic.total / gib:.1f} GiB"
            phases = plan.slot_phases(slot)
            if phases is not None and slot.engine is not None:
                role += f" + engine {slot.engine.engine} (colocated)"
                peak = phases.peak
                big = max(peak.gpu, key=lambda k: peak.gpu[k])
                detail = f"peak in phase {peak.name}, largest part: {big} {peak.gpu[big] / gib:.1f} GiB"
        else:
            key = ("engine",)
            role = f"engine {slot.engine.engine}" if slot.engine else "idle"
            detail = "rollout.gpu_memory_utilization"
        if key in seen:
            continue
        seen.add(key)
        plan.reasons.append(
            f"node {slot.node} GPU {slot.gpu}, {role}: needs {used / gib:.1f} GiB > cluster.gpu_memory_gb="
            f"{cap / gib:g} by {(used - cap) / gib:.1f} GiB ({detail})")
    e = plan.engine_memory
    if e is not None and any(s.engine for s in plan.slots):
        fixed = e.weights + e.lora + e.activations + e.runtime
        if e.kv_cache <= 0:
            lora = f" + LoRA slots {e.lora / gib:.1f}" if e.lora else ""
            plan.reasons.append(
                f"engine: weights {e.weights / gib:.1f}{lora} + activations {e.activations / gib:.1f} + runtime "
                f"{e.runtime / gib:.1f} = {fixed / gib:.1f} GiB leave no KV cache within "
                "rollout.gpu_memory_utilization="
                f"{plan.cfg.rollout.gpu_memory_utilization} x {cap / gib:g} GiB = {e.budget / gib:.1f} GiB "
                f"(raise rollout.engine_tp)"
            )
        elif e.kv_tokens < e.max_model_len:
            plan.reasons.append(
                f"engine: KV cache of {e.kv_cache / gib:.1f} GiB holds {e.kv_tokens} tokens < one sequence of "
                f"max_model_len={e.max_model_len} (set rollout.max_model_len or raise rollout.engine_tp)")

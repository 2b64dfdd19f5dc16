"""`format_plan(plan)`: the text `--dry-run` prints (layout, placement, memory, verdict).

One line per GPU so that `grep "node 3 "` answers "what runs on node 3"; the last line is the
verdict (`fits` or `DOES NOT FIT`), so scripts can read the tail.
"""

from __future__ import annotations

from mlrl.plan.memory import GIB, Phase
from mlrl.plan.planner import Plan


def _g(x: float) -> str:
    return f"{x / GIB:.2f}"


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f}"


def _ranges(idx: list[int]) -> str:
    if not idx:
        return "-"
    out, start, prev = [], idx[0], idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def _header(plan: Plan) -> list[str]:
    cfg, L, s = plan.cfg, plan.layout, plan.shape
    t, r, c = cfg.trainer, cfg.rollout, cfg.cluster
    kind = (f"MoE, {s.experts} experts top-{s.top_k}, {_count(s.total_params(active=True))} active"
            if s.is_moe else "dense")
    lines = [
        f"model    {s.name} ({s.model_type}): {_count(s.total_params())} parameters ({kind}); {s.layers} layers, "
        f"hidden {s.hidden}, {s.heads} heads / {s.kv_heads} KV heads, vocab {s.vocab}",
    ]
    if plan.cpu:
        lines.append(
            "cluster  this machine, CPU only (cluster.gpus_per_node=0): trainer processes "
            f"{'and engines ' if plan.num_engines else ''}share the cores"
        )
    else:
        lines.append(f"cluster  {c.nodes} node(s) x {c.gpus_per_node} GPUs = {L.total_devices} GPUs of "
                     f"{c.gpu_memory_gb:g} GiB, placement {c.placement}")
    lines.append(
        f"trainer  {L.trainer_devices} {'process(es)' if plan.cpu else 'GPUs'}: tp={L.tp} pp={L.pp} vpp={L.vpp or '-'} "
        f"cp={L.cp} dp={L.dp} | ep={L.ep} etp={L.etp} edp={plan.expert_dp}; sequence_parallel="
        f"{'on' if cfg.parallel.sequence_parallel else 'off'}, precision {cfg.model.precision}, fp8 {t.fp8_recipe}, "
        f"recompute {t.recompute}, distributed optimizer {'on' if t.use_distributed_optimizer else 'off'}")
    lora = cfg.model.lora
    if lora is not None:
        n = s.lora_params(lora.rank, lora.targets)
        lines.append(f"         LoRA on: rank {lora.rank}, alpha {lora.alpha:g}, targets {', '.join(lora.targets)}; "
                     f"{_count(n)} adapter parameters ({100 * n / s.total_params():.2f}% of the model) are trained, "
                     "the base is frozen (no gradients or optimizer state; the KL reference is the base"
                     f"{' unless algorithm.reference_hf_dir names one' if cfg.algorithm.reference_hf_dir else ''})")
    if cfg.algorithm.reference_hf_dir and cfg.algorithm.kl_coef > 0:
        lines.append(f"         KL reference: {cfg.algorithm.reference_hf_dir} (algorithm.reference_hf_dir), a frozen "
                     "model of its own on the same ranks and layout (its parameters: the 'reference' term below)")
    if plan.critic_params is not None:
        chf = plan.cfg.critic.hf_dir if plan.cfg.critic is not None else None
        model = f"of {chf}'s architecture" if chf else "of the same architecture"
        lines.append(f"         critic: a value model {model} (value head instead of the output layer) "
                     "on the same ranks and layout, with its own gradients and optimizer state")
    for k, ls in enumerate(plan.stage_layers):
        head = " + scalar head" if cfg.rm is not None else " + output layer"  # a reward model's replaces the LM head
        extra = (" + embedding" if k == 0 else "") + (head if k == L.pp - 1 else "")
        sp = plan.stage_params[k]
        adapters = f" ({_count(sp.adapter)} of them LoRA adapters)" if sp.adapter else ""
        critic = f" (+ critic {_count(plan.critic_params[k].total)})" if plan.critic_params is not None else ""
        lines.append(f"         pp stage {k}: {len(ls)} layers ({_ranges(ls)}){extra}; "
                     f"{_count(sp.total)} parameters{adapters}{critic} per {'process' if plan.cpu else 'GPU'}")
    if s.experts:
        lines.append(f"         experts: {s.experts} per MoE layer, {plan.experts_per_rank} per EP rank")
    micro = f"micro-batch {t.token_budget} tokens -> {plan.micro_batches} micro-batches per DP rank"
    if cfg.sft is not None:
        lines.append(f"batch    SFT: {cfg.sft.batch_size} conversations per optimizer step, <= {plan.seq_len} tokens "
                     f"each; {micro}")
    elif cfg.dpo is not None:
        d = cfg.dpo
        lines.append(f"batch    DPO ({d.loss_type}, beta {d.beta:g}): {d.batch_size} preference pairs "
                     f"= {plan.samples} sequences per optimizer step, <= {plan.seq_len} tokens each, each pair in one "
                     f"micro-batch; {micro}; a frozen reference copy on every rank")
    elif cfg.rm is not None:
        lines.append(f"batch    reward model (Bradley-Terry): {cfg.rm.batch_size} preference pairs = {plan.samples} "
                     f"sequences per optimizer step, <= {plan.seq_len} tokens each, each pair in one micro-batch; "
                     f"{micro}; a scalar head in place of the LM head")
    else:
        lines.append(f"batch    {t.prompts_per_step} prompts x {t.samples_per_prompt} samples / "
                     f"{t.mini_batches_per_step} mini-batch(es) = {plan.samples} samples per optimizer step, "
                     f"<= {plan.seq_len} tokens each; {micro}")
    if plan.num_engines == 0:
        named = {"sft": "an SFT", "dpo": "a DPO", "rm": "a reward-model"}[cfg.offline or "sft"]
        lines.append(f"engines  none: {named} run trains on a fixed dataset")
    elif plan.cpu:
        lines.append(
            f"engines  {r.num_engines} vLLM CPU server(s), engine_tp={r.engine_tp}, KV cache {r.cpu_kv_cache_gb:g} "
            "GiB each"
        )
    else:
        e = plan.engine_memory
        lines.append(f"engines  {r.num_engines} x engine_tp {r.engine_tp} = {r.num_engines * r.engine_tp} GPUs "
                     f"(vLLM, {cfg.model.dtype}, gpu_memory_utilization {r.gpu_memory_utilization}, "
                     f"max_model_len {e.max_model_len if e else '-'})")
    rm = cfg.reward_model
    if plan.judge_engines and rm is not None:
        gpus = rm.num_engines * rm.engine_tp
        where = "vLLM CPU server(s)" if plan.cpu else f"x engine_tp {rm.engine_tp} = {gpus} GPUs"
        lines.append(f"judge    reward_model {rm.hf_dir} ({rm.kind}): {rm.num_engines} {where}, frozen (never "
                     f"synced); engine {plan.num_engines}{'+' if plan.judge_engines > 1 else ''} below")
    return lines


def _cpu_processes(plan: Plan) -> list[str]:
    lines = ["", "processes (this machine):"]
    for tr in plan.trainer_ranks():
        lines.append(f"  {tr.describe(plan.shape.is_moe)}   (torchrun, gloo)")
    for e in range(plan.num_engines + plan.judge_engines):
        what = "the judge (reward_model)" if e >= plan.num_engines else "OpenAI API"
        lines.append(f"  engine {e:>3}: vLLM CPU server at {plan.cfg.rollout.host} ({what})")
    lines.append("")
    lines.append("host memory per trainer process (GiB, rough; no GPU memory to fit on a CPU run):")
    for k, m in enumerate(plan.trainer_memory):
        parts = {name: v for name, v in m.parts().items() if name != "runtime"}
        lines.append(f"  pp stage {k}: " + " + ".join(f"{n} {_g(v)}" for n, v in parts.items())
                     + f" = {_g(sum(parts.values()))}")
        lines += _critic_line(m, f"  critic pp stage {k}: ")
    lines.append("result: CPU run, nothing to fit")
    return lines


def _placement(plan: Plan) -> list[str]:
    lines = ["", "placement (node -> GPU -> role), estimated peak GiB:"]
    for slot, used in zip(plan.slots, plan.gpu_bytes):
        judge = slot.engine is not None and slot.engine.engine >= plan.num_engines
        roles = ([slot.trainer.describe(plan.shape.is_moe)] if slot.trainer else []) + \
            ([slot.engine.describe() + (" (judge)" if judge else "")] if slot.engine else [])
        roles = roles or ["idle"]
        lines.append(f"  node {slot.node:>3} GPU {slot.gpu}  {'  +  '.join(roles):<78} {_g(used):>7}")
    return lines


def _critic_line(m, prefix: str) -> list[str]:
    if m.critic is None:
        return []
    parts = " + ".join(f"{name} {_g(v)}" for name, v in m.critic.parts().items())
    return [f"{prefix}{parts} = {_g(m.critic.total)} (the 'critic' term above; its activations are not added: "
            "its passes run when the policy's do not)"]


def _memory(plan: Plan) -> list[str]:
    lines = ["", f"memory per GPU (GiB; capacity {plan.cfg.cluster.gpu_memory_gb:g}):"]
    counts: dict[int, int] = {}
    for s in plan.slots:
        if s.trainer:
            counts[s.trainer.pp] = counts.get(s.trainer.pp, 0) + 1
    for k, m in enumerate(plan.trainer_memory):
        parts = " + ".join(f"{name} {_g(v)}" for name, v in m.parts().items())
        lines.append(f"  trainer pp stage {k} ({counts.get(k, 0)} GPUs): {parts} = {_g(m.total)}")
        lines += _critic_line(m, "    critic on these GPUs: ")
    e = plan.engine_memory
    if e is not None:
        seqs = e.kv_tokens // max(1, plan.seq_len)
        lines.append(
            f"  engine (engine_tp {plan.cfg.rollout.engine_tp}): budget {_g(e.budget)} = weights {_g(e.weights)} + "
            + (f"LoRA slots {_g(e.lora)} + " if e.lora else "")
            + f"activations {_g(e.activations)} + runtime {_g(e.runtime)} + KV cache {_g(e.kv_cache)} "
            f"({e.kv_tokens} tokens at {e.kv_bytes_per_token / 1024:.0f} KiB/token = {seqs} sequences of "
            f"{plan.seq_len})"
        )
        if plan.colocated:
            lines += _colocated(plan)
    return lines


def _parts(parts: dict[str, float]) -> str:
    return " + ".join(f"{name} {_g(v)}" for name, v in parts.items() if v) or "nothing"


def _phase(ph: Phase) -> str:
    return f"phase {ph.name}: {_g(ph.total)} GiB ({_parts(ph.gpu)})"


def _colocated(plan: Plan) -> list[str]:
    """One line per phase of the step on a shared GPU (the peak decides the fit), and the host
    memory the offloaded state takes per node."""
    co = plan.cfg.cluster.colocate
    lines = [f"  colocated GPU, one step (sleep level {co.sleep_level}, offload_params "
             f"{'on' if co.offload_params else 'off'}): rollout -> train -> sync, the GPU holds the largest"]
    for k in range(plan.layout.pp):
        sender, other = plan.colocated_phases(k, sender=True), plan.colocated_phases(k, sender=False)
        peak = sender.peak
        lines.append(f"  colocated GPU, pp stage {k} (its weight-sync sender; peak {_g(peak.total)} in phase "
                     f"{peak.name}):")
        lines += [f"    {_phase(ph)}" for ph in sender]
        if plan.layout.tp * plan.layout.dp * plan.layout.cp > 1 and other.sync.total != sender.sync.total:
            lines.append(f"    phase sync on the stage's other GPUs: {_g(other.sync.total)} GiB (transport buffers "
                         f"{_g(other.sync.gpu['transport buffers'])})")
    host = plan.host_bytes_per_node()
    if host and host[0]:
        node = max(range(len(host)), key=lambda n: max(host[n].values(), default=0.0))
        h = plan.colocated_phases(0)
        held = {"rollout": "optimizer state" + (" + parameters" if co.offload_params else ""),
                "train": "engine weights" if co.sleep_level == 1 else "nothing: sleep level 2 discards the weights",
                "sync": "optimizer state"}
        lines.append(f"  host memory, node {node} (offloaded state, not checked: no host capacity in the config): "
                     + ", ".join(f"{ph.name} {_g(host[node].get(ph.name, 0.0))} ({held[ph.name]})" for ph in h))
    return lines


def _verdict(plan: Plan) -> list[str]:
    lines = [""]
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    if plan.fits:
        if plan.gpu_bytes:
            i = max(range(len(plan.gpu_bytes)), key=plan.gpu_bytes.__getitem__)
            s = plan.slots[i]
            lines.append(f"result: fits (peak {_g(plan.gpu_bytes[i])} of {plan.cfg.cluster.gpu_memory_gb:g} GiB "
                         f"on node {s.node} GPU {s.gpu})")
    else:
        lines.append("result: DOES NOT FIT")
        lines += [f"  - {why}" for why in plan.reasons]
        colocated = ("; colocated: lower rollout.gpu_memory_utilization or cluster.colocate.offload_params=true "
                     "for the rollout phase") if plan.colocated else ""
        lines.append("  (options: larger parallel.tp / pp / ep, trainer.use_distributed_optimizer=true, "
                     f"trainer.recompute=full, smaller trainer.micro_batch_tokens, more nodes{colocated})")
    return lines


def format_plan(plan: Plan) -> str:
    lines = _header(plan)
    if plan.cpu:
        lines += _cpu_processes(plan)
        lines += [f"warning: {w}" for w in plan.warnings]
    else:
        lines += _placement(plan) + _memory(plan) + _verdict(plan)
    return "\n".join(lines)

"""--dry-run planner: parameter counts, rank coordinates, memory terms and the CLI on 1/2/16 nodes.

Hand-checked numbers come from the published HF config.json of Qwen3-8B / Qwen3-30B-A3B (the
PRESETS in mlrl.modelzoo), written out here term by term rather than recomputed by the planner.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from mlrl.config import load_config, resolve_layout, validate
from mlrl.modelzoo import PRESETS
from mlrl.plan import format_plan, make_plan, trainer_rank
from mlrl.plan import memory as mem
from mlrl.plan.model import model_shape

ROOT = Path(__file__).resolve().parents[3]
QWEN8B = ROOT / "launch" / "qwen3_8b_grpo.yaml"
QWEN30B = ROOT / "launch" / "qwen3_30b_a3b_fp8.yaml"
GIB = 1024**3

# Qwen3-8B by hand: V=151936, h=4096, L=36, 32 heads x 128, 8 KV heads x 128, f=12288, untied.
EMB_8B = 151936 * 4096
ATTN_8B = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096      # q, k, v, o
MLP_8B = 3 * 4096 * 12288
NORMS_8B = 2 * 4096 + 2 * 128                                # 2 RMSNorms + Qwen3 q/k norms


def plan_for(recipe, *overrides):
    cfg = load_config(recipe, list(overrides))
    return make_plan(cfg, validate(cfg, dry_run=True))


def lora_plan(recipe, *overrides):
    """A plan built from the planner's inputs directly (load_config + resolve_layout): the LoRA rules
    of `validate` are tested in tests/unit/config."""
    cfg = load_config(recipe, list(overrides))
    return make_plan(cfg, resolve_layout(cfg))


def run_cli(*args):
    """`python -m mlrl.launch ...` in a subprocess (each costs an interpreter + imports: a few seconds)."""
    return subprocess.run(
        [sys.executable, "-m", "mlrl.launch", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def run_main(capsys, *args):
    """The same entry point in-process (mlrl.launch.main), for the cheaper checks."""
    from mlrl.launch import main

    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_qwen3_param_totals_match_published_sizes():
    s8 = model_shape(PRESETS["Qwen/Qwen3-8B"], "8b")
    assert s8.total_params() == 36 * (ATTN_8B + MLP_8B + NORMS_8B) + 2 * EMB_8B + 4096 == 8_190_735_360
    s30 = model_shape(PRESETS["Qwen/Qwen3-30B-A3B"], "30b")
    attn = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048
    per_layer = attn + 2 * 2048 + 2 * 128 + 2048 * 128          # + router
    expert = 3 * 2048 * 768
    emb = 151936 * 2048
    assert s30.total_params() == 48 * (per_layer + 128 * expert) + 2 * emb + 2048 == 30_532_122_624
    assert s30.total_params(active=True) == 48 * (per_layer + 8 * expert) + 2 * emb + 2048  # 3.35 B
    assert all(s30.moe_layer) and not any(s8.moe_layer)


def test_qwen3_8b_params_per_tp_rank_and_bytes():
    plan = plan_for(QWEN8B, "cluster.nodes=1", "rollout.num_engines=2", "parallel.tp=4")
    per_rank = 36 * (ATTN_8B + MLP_8B) // 4 + 36 * NORMS_8B + 2 * EMB_8B // 4 + 4096
    assert per_rank == 2_047_915_008
    assert plan.stage_params[0].total == per_rank
    m = plan.trainer_memory[0]
    assert m.params == 2 * per_rank                       # bf16
    assert m.grads == 4 * per_rank                        # fp32 main grads
    assert m.optimizer == 12 * per_rank                   # dp=1: distributed optimizer shards nothing
    assert round(m.params / GIB, 2) == 3.81


def test_distributed_optimizer_divides_adam_state_by_dp():
    on = plan_for(QWEN8B).trainer_memory[0]                               # tp=2, dp=32
    off = plan_for(QWEN8B, "trainer.use_distributed_optimizer=false").trainer_memory[0]
    assert off.optimizer == pytest.approx(32 * on.optimizer)
    assert off.params == on.params and off.grads == on.grads


CRITIC = ("algorithm.advantage=gae", "critic.lr=1e-6")


def test_the_critic_is_sized_as_its_own_model(tmp_path):
    """critic.hf_dir may name another model than the policy (same vocabulary): the critic's memory
    was the policy's shape whatever that model was."""
    import json

    bigger = dict(PRESETS["Qwen/Qwen3-8B"], num_hidden_layers=72)  # a deeper critic, same vocabulary and width
    (tmp_path / "config.json").write_text(json.dumps(bigger))
    same = plan_for(QWEN8B, *CRITIC)
    deeper = plan_for(QWEN8B, *CRITIC, f"critic.hf_dir={tmp_path}")
    # 36 more layers, each split over tp=2 (its norms replicated)
    assert deeper.critic_params[0].total - same.critic_params[0].total == 36 * (ATTN_8B + MLP_8B) // 2 + 36 * NORMS_8B
    assert deeper.trainer_memory[0].critic.params == 2 * deeper.critic_params[0].total  # bf16
    # the policy's own terms are unchanged; the activation peak is the deeper critic's pass now
    policy_parts = [{k: v for k, v in pl.trainer_memory[0].parts().items() if k not in ("critic", "activations")}
                    for pl in (same, deeper)]
    assert policy_parts[0] == policy_parts[1]
    assert deeper.trainer_memory[0].activations > same.trainer_memory[0].activations


def test_critic_adds_its_params_grads_and_optimizer_per_gpu():
    base = plan_for(QWEN8B)                                                  # tp=2, dp=32, bf16, Adam, dist. opt.
    with_critic = plan_for(QWEN8B, *CRITIC)
    policy = 36 * (ATTN_8B + MLP_8B) // 2 + 36 * NORMS_8B + 2 * EMB_8B // 2 + 4096
    critic = policy - EMB_8B // 2 + 4096        # no output layer (vocab-parallel over tp=2); an h x 1 value head
    assert with_critic.critic_params[0].total == critic == 3_784_360_960 and base.critic_params is None
    m0, m1 = base.trainer_memory[0], with_critic.trainer_memory[0]
    c = m1.critic
    assert (c.params, c.grads) == (2 * critic, 4 * critic)                   # bf16 weights, fp32 main grads
    assert c.optimizer == pytest.approx(12 * critic / 32)                    # Adam state sharded over dp=32
    assert m1.total - m0.total == pytest.approx(critic * (2 + 4 + 12 / 32))  # ~22.5 GiB more per GPU
    # the policy's own terms, and the activation peak, do not change
    assert {k: v for k, v in m1.parts().items() if k != "critic"} == m0.parts()
    # colocated rollout phase: the critic's parameters stay resident, grads and Adam state are offloaded
    e = with_critic.engine_memory
    assert mem.colocated_phases(m1, e).rollout.total - mem.colocated_phases(m0, e).rollout.total == 2 * critic


def test_critic_that_does_not_fit_is_exit_code_3(capsys):
    # the recipe fits without a critic (67 GiB per trainer GPU) but not with one (~90 GiB)
    plain = run_main(capsys, "--config", str(QWEN8B), "--dry-run")
    assert plain.returncode == 0 and "result: fits" in plain.stdout
    out = run_main(capsys, "--config", str(QWEN8B), "--dry-run", *CRITIC)
    assert out.returncode == 3
    assert (
        "critic 22.47 = 89.61" in out.stdout
        and "critic on these GPUs: params 7.05 + grads 14.10 + optimizer 1.32" in out.stdout
    )
    assert "needs 89.6 GiB > cluster.gpu_memory_gb=80" in out.stderr and "the critic adds 22.5 GiB" in out.stderr
    # and a layout with tp=4 halves both models: fits again
    assert run_main(capsys, "--config", str(QWEN8B), "--dry-run", *CRITIC, "parallel.tp=4").returncode == 0


# LoRA on Qwen3-8B, peft's A [r, in] + B [out, r] per module and layer, written out module by module
LORA_8B = (
    (4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096)      # q, k, v (in h, out q / kv), o (in q, out h)
    + 2 * (4096 + 12288) + (12288 + 4096)                  # gate, up (in h, out f), down (in f, out h)
)
# per TP rank of tp=2: column-parallel q/k/v/gate/up split B's out, row-parallel o/down split A's in
LORA_8B_TP2 = (
    (4096 + 4096 // 2) + 2 * (4096 + 1024 // 2) + (4096 // 2 + 4096)
    + 2 * (4096 + 12288 // 2) + (12288 // 2 + 4096)
)


def test_lora_adapter_params_closed_form():
    from mlrl.config.schema import LORA_TARGETS

    s = model_shape(PRESETS["Qwen/Qwen3-8B"], "8b")
    assert s.lora_params(16, LORA_TARGETS) == 36 * 16 * LORA_8B == 43_646_976     # what peft prints for Qwen3-8B
    assert s.lora_params(16, ("q_proj", "v_proj")) == 36 * 16 * ((4096 + 4096) + (4096 + 1024))
    plan = lora_plan(QWEN8B, "model.lora.rank=16")                                 # tp=2 dp=32
    assert plan.stage_params[0].adapter == 36 * 16 * LORA_8B_TP2 == 30_081_024
    assert "LoRA on: rank 16, alpha 32, targets q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; " \
        "43.65 M adapter parameters" in format_plan(plan)


def test_lora_frozen_base_keeps_params_trains_adapters_only():
    full = plan_for(QWEN8B)                                     # tp=2, dp=32, bf16, Adam, distributed optimizer
    lora = lora_plan(QWEN8B, "model.lora.rank=16")
    n = 36 * 16 * LORA_8B_TP2
    pf, pl = full.stage_params[0], lora.stage_params[0]
    assert (pl.dense, pl.expert, pl.linear) == (pf.dense, pf.expert, pf.linear)   # the base, whole, on every GPU
    mf, ml = full.trainer_memory[0], lora.trainer_memory[0]
    assert ml.params == mf.params + 2 * n                       # base resident (bf16) + the bf16 adapters
    assert ml.grads == 4 * n                                    # fp32 main grads of the adapters only
    assert ml.optimizer == pytest.approx(12 * n / 32)           # fp32 master + Adam m, v of the adapters, over dp
    assert (mf.grads + mf.optimizer) / (ml.grads + ml.optimizer) >= 10     # ~140x here
    assert ml.total < mf.total - 16 * GIB
    # colocated: rollout keeps the base and the adapters resident; training holds the smaller LoRA total
    # (beside the sleeping engine's runtime: CUDA context and CUDA-graph pool)
    e = lora.engine_memory
    cf, cl = mem.colocated_phases(mf, e), mem.colocated_phases(ml, e)
    assert cl.rollout.total - cf.rollout.total == 2 * n
    assert cl.train.total == ml.total + e.runtime and cf.train.total - cl.train.total > 16 * GIB
    # KL against the reference: a second copy of the weights, except under LoRA (the base, adapters off)
    assert plan_for(QWEN8B, "algorithm.kl_coef=0.01").trainer_memory[0].reference == mf.params
    assert lora_plan(QWEN8B, "model.lora.rank=16", "algorithm.kl_coef=0.01").trainer_memory[0].reference == 0


def test_lora_estimate_grows_with_rank():
    small, large = (lora_plan(QWEN8B, f"model.lora.rank={r}") for r in (8, 64))
    assert large.stage_params[0].adapter == 8 * small.stage_params[0].adapter
    ms, ml = small.trainer_memory[0], large.trainer_memory[0]
    for part in ("params", "grads", "optimizer", "activations"):
        assert getattr(ml, part) > getattr(ms, part), part
    assert ml.total > ms.total


def test_lora_activation_terms():
    from mlrl.config.schema import LoRAConfig

    s = model_shape(PRESETS["Qwen/Qwen3-8B"], "8b")
    kw = dict(act_bytes=2, tp=2, sp=True)
    # h = A x per module: r on the 5 column-parallel modules, r / t on the 2 row-parallel ones with SP
    assert mem.lora_activation_bytes(s, 0, LoRAConfig(rank=16), **kw) == 5 * 16 * 2 + 2 * 16 * 2 / 2
    # dropout: a dropped copy (B) and mask (1 byte) of each adapted linear's input, sharded over tp with SP
    drop = mem.lora_activation_bytes(s, 0, LoRAConfig(rank=16, dropout=0.1), **kw)
    assert drop - 192 == (2 + 1) * (4096 + 4096 + 4096 + 12288) / 2      # qkv, proj, fc1, fc2 inputs
    attn = LoRAConfig(rank=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    assert mem.lora_activation_bytes(s, 0, attn, **kw) == 3 * 16 * 2 + 16 * 2 / 2


def test_lora_on_moe_model_trains_attention_adapters_only():
    plan = lora_plan(QWEN30B, "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")   # tp=2 pp=2 dp=16 edp=4
    per_layer = 16 * ((2048 + 4096 // 2) + 2 * (2048 + 512 // 2) + (4096 // 2 + 2048))       # h 2048, q 4096, kv 512
    p0, m0 = plan.stage_params[0], plan.trainer_memory[0]
    assert p0.adapter == 24 * per_layer
    assert m0.grads == 4 * p0.adapter and m0.optimizer == pytest.approx(12 * p0.adapter / 16)  # no expert state
    assert m0.fp8_weights == p0.linear > 0                      # TE's FP8 cache of the frozen base linears stays


def test_lora_adapter_mode_engines_hold_two_lora_slots():
    adapter = ("weight_sync.lora_mode=adapter", "weight_sync.transport=disk")
    merged = lora_plan(QWEN8B, "model.lora.rank=16").engine_memory
    assert merged.lora == 0                                           # merged weights: vLLM runs without LoRA
    # vLLM fills every linear it supports, whatever the targets: attention-only adapters cost all-linear slots
    e = lora_plan(QWEN8B, "model.lora.target_modules=[q_proj,v_proj]", *adapter).engine_memory
    assert e.lora == 2 * 36 * 16 * LORA_8B_TP2 * 2                    # 2 slots, engine_tp=2, bf16
    assert e.kv_cache == merged.kv_cache - e.lora
    # rank 20 is served at vLLM's next --max-lora-rank, 32
    assert lora_plan(QWEN8B, "model.lora.rank=20", *adapter).engine_memory.lora == 2 * e.lora
    # MoE: a slot on each of the 128 routed experts too (gate, up, down at engine_tp=2), ~2.7 GiB per GPU
    moe = lora_plan(QWEN30B, "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]", *adapter).engine_memory
    attn = 16 * ((2048 + 4096 // 2) + 2 * (2048 + 512 // 2) + (4096 // 2 + 2048))
    experts = 128 * 16 * (3 * 2048 + 3 * 768 // 2)
    assert moe.lora == 2 * 48 * (attn + experts) * 2


def test_moe_expert_sharding_and_expert_dp():
    plan = plan_for(QWEN30B)                               # tp=2 pp=2 ep=8 etp=1 -> dp=16, edp=4
    assert plan.experts_per_rank == 16 and plan.expert_dp == 4
    p0 = plan.stage_params[0]
    assert p0.expert == 24 * 16 * 3 * 2048 * 768           # 24 layers x 16 local experts
    m = plan.trainer_memory[0]
    assert m.optimizer == pytest.approx(p0.dense * 12 / 16 + p0.expert * 12 / 4)
    assert m.fp8_weights == p0.linear > 0


def test_rank_coordinates_match_megatron_rank_generator():
    from megatron.core.parallel_state import RankGenerator

    from mlrl.config.validate import Layout

    layout = Layout(
        tp=2, pp=2, cp=2, ep=2, etp=1, dp=2, vpp=None, trainer_devices=16, rollout_devices=0, total_devices=16
    )
    coords = {r: trainer_rank(r, layout) for r in range(16)}
    dense = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=1, ep=2, dp=4, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    for gen, fields in ((dense, ("tp", "cp", "dp", "pp")), (expert, ("etp", "ep", "edp", "pp"))):
        for name, token in zip(fields, ("tp", "cp" if gen is dense else "ep", "dp", "pp")):
            for group in gen.get_ranks(token):
                # inside a group the coordinate runs 0..n-1 and every other coordinate is constant
                assert [getattr(coords[r], name) for r in group] == list(range(len(group)))
                others = [f for f in fields if f != name]
                assert len({tuple(getattr(coords[r], f) for f in others) for r in group}) == 1


def test_activation_terms():
    s = model_shape(PRESETS["Qwen/Qwen3-8B"], "8b")
    kw = dict(act_bytes=2, tp=2, etp=2, flash=True, seq_len=4096)
    # tp=2 + sequence parallel, bf16: 4h*2/2 + (2q+2kv)*2/2 + 3f*2/2 bytes per token
    sp = mem.layer_activation_bytes(s, False, sp=True, recompute="selective", **kw)
    assert sp == 4 * 4096 + (2 * 4096 + 2 * 1024) + 3 * 12288 == 63488
    no_sp = mem.layer_activation_bytes(s, False, sp=False, recompute="selective", **kw)
    assert no_sp - sp == 4 * 4096 * 2 / 2                    # replicated term no longer divided by tp
    unfused = dict(kw, flash=False)
    none = mem.layer_activation_bytes(s, False, sp=True, recompute="none", **unfused)
    sel = mem.layer_activation_bytes(s, False, sp=True, recompute="selective", **unfused)
    assert none - sel == 32 * 4096 * 2 / 2                  # softmax output a*s*B/t, dropped by selective
    layers = list(range(36))
    common = dict(last=False, tokens=1000, inflight=1, act_bytes=2, tp=2, etp=2, sp=True, flash=True, seq_len=4096)
    full = mem.stage_activation_bytes(s, layers, recompute="full", **common)
    assert full == 1000 * (36 * 4096 * 2 / 2 + sp)          # layer inputs + one layer's working set
    assert mem.inflight_microbatches(0, 4, None, 100) == 4 and mem.inflight_microbatches(3, 4, None, 100) == 1
    assert mem.inflight_microbatches(0, 4, None, 2) == 2
    assert mem.inflight_microbatches(0, 4, 2, 100) == pytest.approx(4 * (1 + 3 / 8))


def test_engine_kv_cache_per_token():
    plan = plan_for(QWEN8B)
    e = plan.engine_memory
    assert e.kv_bytes_per_token == 2 * 36 * (8 // 2) * 128 * 2       # K and V, 4 KV heads per TP rank, bf16
    assert e.weights == 8_190_735_360 * 2 / 2
    assert e.budget == 0.85 * 80 * GIB
    assert e.kv_cache == pytest.approx(e.budget - e.weights - e.activations - e.runtime)


def test_engine_activations_follow_vllms_batch_defaults_for_the_gpus_memory():
    """vLLM's API server profiles max_num_batched_tokens tokens and the logits of max_num_seqs
    sequences, both larger on big GPUs (2048 / 256 below 70 GiB, 8192 / 1024 up to 160, 16384 /
    1024 above): the activation estimate, and the KV cache left, follow the GPU's memory."""
    assert [mem.vllm_batch_defaults(g * GIB) for g in (24, 48, 79.1, 139.8, 178)] == [
        (2048, 256), (2048, 256), (8192, 1024), (8192, 1024), (16384, 1024)]
    default = plan_for(QWEN8B).engine_memory  # cluster.gpu_memory_gb 80
    acts = {}
    for gib in (48, 80, 180):
        e = plan_for(QWEN8B, f"cluster.gpu_memory_gb={gib}").engine_memory
        acts[gib] = e.activations
        assert e.kv_cache == pytest.approx(e.budget - e.weights - e.activations - e.runtime)
    assert acts[48] < acts[80] < acts[180] and acts[80] == default.activations
    vocab_logits = 151936 * 4 / 2  # one sequence's fp32 logits on an engine TP rank (tp 2)
    assert acts[80] - acts[48] > (1024 - 256) * vocab_logits  # 4x the sequences, and 4x the tokens


# --- the CLI --------------------------------------------------------------------------------

def test_cli_qwen3_8b_16_nodes():
    out = run_cli("--config", str(QWEN8B), "--dry-run", "--nodes", "16")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "16 node(s) x 8 GPUs = 128 GPUs" in text and "tp=2 pp=1 vpp=- cp=1 dp=32" in text
    gpu_lines = [ln for ln in text.splitlines() if ln.startswith("  node ")]
    assert len(gpu_lines) == 128
    assert sum("trainer rank" in ln for ln in gpu_lines) == 64 and sum("engine" in ln for ln in gpu_lines) == 64
    assert "node   0 GPU 3  trainer rank    3  tp1 cp0 dp1 pp0" in text
    assert "node   7 GPU 7  trainer rank   63  tp1 cp0 dp31 pp0" in text
    assert "node   8 GPU 0  engine   0 tp-rank 0" in text and "node  15 GPU 7  engine  31 tp-rank 1" in text
    assert "trainer pp stage 0 (64 GPUs): params 7.63 + grads 15.26" in text     # 4.096 B params x 2 / 4 bytes
    assert text.rstrip().splitlines()[-1].startswith("result: fits")


def test_cli_qwen3_30b_a3b_16_nodes():
    out = run_cli("--config", str(QWEN30B), "--dry-run", "--nodes", "16")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "tp=2 pp=2 vpp=- cp=1 dp=16 | ep=8 etp=1 edp=4" in text and "fp8 blockwise" in text
    assert "experts: 128 per MoE layer, 16 per EP rank" in text
    assert "pp stage 0: 24 layers (0-23) + embedding" in text and "pp stage 1: 24 layers (24-47) + output layer" in text
    # rank 9: tp=9%2=1, dp=(9//2)%16=4, pp=0; ep=9%8=1, edp=(9//8)%4=1
    assert "trainer rank    9  tp1 cp0 dp4 pp0 | ep1 etp0 edp1" in text
    # rank 32 is the first rank of pp stage 1
    assert "node   4 GPU 0  trainer rank   32  tp0 cp0 dp0 pp1" in text
    assert "result: fits" in text


@pytest.mark.parametrize("nodes,extra,trainer_gpus,engine_line", [
    (1, ["rollout.num_engines=2", "parallel.tp=4"], 4, "node   0 GPU 4  engine   0 tp-rank 0"),
    (2, ["rollout.num_engines=4"], 8, "node   1 GPU 0  engine   0 tp-rank 0"),
])
def test_cli_qwen3_8b_scaled_down(nodes, extra, trainer_gpus, engine_line):
    out = run_cli("--config", str(QWEN8B), "--dry-run", "--nodes", str(nodes), *extra)
    assert out.returncode == 0, out.stderr
    assert f"trainer  {trainer_gpus} GPUs" in out.stdout and engine_line in out.stdout
    assert "result: fits" in out.stdout
    if nodes == 1:
        assert "params 3.81 + grads 7.63 + optimizer 22.89" in out.stdout   # tp=4, dp=1: 2.048 B x (2, 4, 12) bytes


def test_cli_colocated_two_nodes(capsys):
    out = run_main(
        capsys,
        "--config",
        str(QWEN8B),
        "--dry-run",
        "--nodes",
        "2",
        "cluster.placement=colocated",
        "rollout.num_engines=8",
        "weight_sync.transport=disk",  # colocated on GPUs: see validate._check_colocate_transport
    )
    assert out.returncode == 0, out.stderr
    assert "node   1 GPU 7  trainer rank   15  tp1 cp0 dp7 pp0  +  engine   7 tp-rank 1" in out.stdout
    assert "colocated GPU, pp stage 0 (its weight-sync sender; peak " in out.stdout
    assert all(f"    phase {name}: " in out.stdout for name in ("rollout", "train", "sync"))


def test_cli_lora_dry_run(capsys):
    out = run_main(capsys, "--config", str(QWEN8B), "--dry-run", "model.lora.rank=16")
    assert out.returncode == 0, out.stderr
    assert "LoRA on: rank 16, alpha 32" in out.stdout and "43.65 M adapter parameters" in out.stdout
    assert "4.13 B parameters (30.08 M of them LoRA adapters) per GPU" in out.stdout
    assert "params 7.68 + grads 0.11 + optimizer 0.01" in out.stdout      # vs params 7.63 + grads 15.26 + opt. 1.43


def test_cli_does_not_fit_reports_gpu_role_and_excess():
    out = run_cli("--config", str(QWEN8B), "--dry-run", "--nodes", "1", "rollout.num_engines=2", "parallel.tp=1",
                  "parallel.sequence_parallel=false", "trainer.use_distributed_optimizer=false")
    assert out.returncode == 3
    assert "result: DOES NOT FIT" in out.stdout
    line = next(ln for ln in out.stderr.splitlines() if "does not fit" in ln)
    assert "node 0 GPU 0, trainer rank 0 (pp stage 0): needs" in line and "> cluster.gpu_memory_gb=80 by" in line
    need = float(line.split("needs ")[1].split(" GiB")[0])
    assert need > 18 * 8_190_735_360 / GIB                   # at least bf16 params + fp32 grads + Adam: 18 B/param


def test_cli_engine_without_room_for_kv_cache(capsys):
    out = run_main(
        capsys,
        "--config",
        str(QWEN30B),
        "--dry-run",
        "rollout.engine_tp=1",
        "rollout.num_engines=64",
        "cluster.gpu_memory_gb=40",
    )
    assert out.returncode == 3
    assert "engine: weights 56.9" in out.stderr and "leave no KV cache" in out.stderr


def test_cli_layout_error_is_a_config_error(capsys):
    out = run_main(capsys, "--config", str(QWEN8B), "--dry-run", "--nodes", "1")     # 32 engines x 2 GPUs > 8 GPUs
    assert out.returncode == 2
    assert "leave none for the trainer" in out.stderr


def test_engines_never_span_nodes():
    from mlrl.config.validate import Layout
    from mlrl.plan.placement import place

    layout = Layout(
        tp=1, pp=1, cp=1, ep=1, etp=1, dp=1, vpp=None, trainer_devices=1, rollout_devices=15, total_devices=16
    )
    slots, problems = place(layout, nodes=2, gpus_per_node=8, num_engines=4, engine_tp=3, colocated=False)
    assert problems == []
    # GPUs 1-3 and 4-6 on node 0; GPU 7 cannot start an engine of 3, so engine 2 starts on node 1
    assert [s.engine.engine if s.engine else None for s in slots] == [
        None,
        0,
        0,
        0,
        1,
        1,
        1,
        None,
        2,
        2,
        2,
        3,
        3,
        3,
        None,
        None,
    ]
    _, problems = place(layout, nodes=2, gpus_per_node=8, num_engines=5, engine_tp=3, colocated=False)
    assert problems and "only 4 of rollout.num_engines=5 engines" in problems[0]
    _, problems = place(layout, nodes=2, gpus_per_node=8, num_engines=3, engine_tp=3, colocated=True)
    assert problems and "would span nodes 0 and 1" in problems[0]


def test_cpu_run_prints_process_layout():
    cfg = load_config(
        ROOT / "launch" / "cpu_default.yaml", ["cluster.trainer_devices=4", "parallel.tp=2", "parallel.pp=2"]
    )
    plan = make_plan(cfg, validate(cfg, dry_run=True))
    text = format_plan(plan)
    assert plan.fits and plan.slots == []
    assert "trainer rank    3  tp1 cp0 dp0 pp1   (torchrun, gloo)" in text
    assert "engine   0: vLLM CPU server" in text and "result: CPU run" in text


def test_smollm2_cpu_recipe_matches_its_task():
    from mlrl.data.synthetic import TASKS
    from mlrl.reward import list_rewards

    cfg = load_config(ROOT / "launch" / "smollm2_cpu.yaml")
    assert cfg.model.hf_dir == "builtin:smollm2-135m-instruct" and cfg.cluster.gpus_per_node == 0
    task = cfg.data.train.removeprefix("synthetic:")
    assert TASKS[task].reward == cfg.workflow.reward and cfg.workflow.reward in list_rewards()


def test_engine_lora_slots_are_the_servers():
    from mlrl.plan.memory import ENGINE_LORA_SLOTS
    from mlrl.rollout.server import MAX_LORAS
    from mlrl.weight_sync.lora_adapter import KEEP_LOADED

    # the planner counts the slots the engines are started with; the adapter sync fills exactly those
    assert ENGINE_LORA_SLOTS == MAX_LORAS == KEEP_LOADED


def test_offline_runs_plan_no_engines_and_dpo_counts_its_reference():
    """An SFT / DPO run starts no engines: every GPU is a trainer rank's. DPO holds a frozen
    reference (one more copy of the parameters), SFT none; the batch is pairs x 2 sequences."""
    gpus = ["cluster.gpus_per_node=8", "model.hf_dir=/shared/models/Qwen3-8B", "model.arch=Qwen/Qwen3-8B"]
    dpo = plan_for(ROOT / "launch" / "dpo_cpu.yaml", *gpus, "dpo.batch_size=64", "trainer.micro_batch_tokens=4096")
    sft = plan_for(ROOT / "launch" / "sft_cpu.yaml", *gpus, "sft.batch_size=64", "trainer.micro_batch_tokens=4096",
                   "sft.max_seq_tokens=256")
    for plan in (dpo, sft):
        assert plan.num_engines == 0 and plan.engine_memory is None and plan.layout.trainer_devices == 8
        assert all(s.trainer and not s.engine for s in plan.slots) and len(plan.slots) == 8
    assert dpo.samples == 128 and sft.samples == 64
    assert dpo.trainer_memory[0].reference == dpo.trainer_memory[0].params > 0 and sft.trainer_memory[0].reference == 0
    text = format_plan(dpo)
    assert "engines  none: a DPO run" in text and "64 preference pairs = 128 sequences" in text
    cpu = format_plan(plan_for(ROOT / "launch" / "dpo_cpu.yaml"))
    assert "engine   0" not in cpu and "reference 0.50" in cpu


def test_a_deeper_critic_of_its_own_model_can_set_the_activation_peak(tmp_path):
    """The critic's activations were left out on the grounds that they are the policy's minus the
    logits: not so for a critic of another, bigger model."""
    import json

    wider = dict(PRESETS["Qwen/Qwen3-8B"], hidden_size=8192, num_attention_heads=64, intermediate_size=24576)
    (tmp_path / "config.json").write_text(json.dumps(wider))
    same = plan_for(QWEN8B, *CRITIC)
    big = plan_for(QWEN8B, *CRITIC, f"critic.hf_dir={tmp_path}")
    assert big.trainer_memory[0].activations > same.trainer_memory[0].activations
    assert f"critic: a value model of {tmp_path}'s architecture" in format_plan(big)


def test_a_kl_reference_of_its_own_is_sized_as_that_model(tmp_path):
    """algorithm.reference_hf_dir (a teacher, same vocabulary): the reference term is the teacher's
    parameters on the rank, not a copy of the policy's; with LoRA it is still there (the base is not
    the reference then)."""
    import json

    bigger = dict(PRESETS["Qwen/Qwen3-8B"], num_hidden_layers=72)
    (tmp_path / "config.json").write_text(json.dumps(bigger))
    kl = ("algorithm.kl_coef=0.01",)
    own = plan_for(QWEN8B, *kl).trainer_memory[0]
    teacher = plan_for(QWEN8B, *kl, f"algorithm.reference_hf_dir={tmp_path}").trainer_memory[0]
    policy = 36 * (ATTN_8B + MLP_8B) // 2 + 36 * NORMS_8B + 2 * EMB_8B // 2 + 4096
    assert own.reference == 2 * policy                                         # bf16 copy of the policy
    assert teacher.reference == 2 * (policy + 36 * (ATTN_8B + MLP_8B) // 2 + 36 * NORMS_8B)  # 72 layers
    assert {k: v for k, v in teacher.parts().items() if k != "reference"} == \
        {k: v for k, v in own.parts().items() if k != "reference"}
    lora = ("model.lora.rank=8",)
    assert lora_plan(QWEN8B, *kl, *lora).trainer_memory[0].reference == 0.0    # the base, adapters off
    assert lora_plan(QWEN8B, *kl, *lora, f"algorithm.reference_hf_dir={tmp_path}").trainer_memory[0].reference == \
        teacher.reference

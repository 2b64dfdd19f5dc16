"""Colocated placement in the --dry-run planner: the per-phase peaks (rollout, train, sync) of a GPU
shared by a trainer rank and an engine rank, the offload set (cluster.colocate), and their rendering.

Qwen3-8B (model.arch preset: no weights needed) on 2 nodes x 8 GPUs: tp=2, dp=8, 8 engines of
engine_tp=2, every GPU holding one trainer rank and one engine rank.
"""

from pathlib import Path

import pytest

from mlrl.config import load_config, validate
from mlrl.plan import format_plan, make_plan

ROOT = Path(__file__).resolve().parents[3]
QWEN8B = ROOT / "launch" / "qwen3_8b_grpo.yaml"
GIB = 1024**3
# colocated on GPUs: NCCL's broadcast cannot hold two ranks of one GPU, CUDA IPC serves one engine GPU: disk
COLOCATED = ("cluster.nodes=2", "cluster.placement=colocated", "rollout.num_engines=8", "weight_sync.transport=disk")
OFFLOAD = "cluster.colocate.offload_params=true"
CRITIC = ("algorithm.advantage=gae", "critic.lr=1e-6")


def plan_for(*overrides):
    cfg = load_config(QWEN8B, list(overrides))
    return make_plan(cfg, validate(cfg, dry_run=True))


def colocated(*overrides):
    return plan_for(*COLOCATED, *overrides)


def test_offload_params_lowers_the_rollout_peak_by_the_trainer_params_only():
    keep, off = colocated(), colocated(OFFLOAD)
    k, o = keep.colocated_phases(0), off.colocated_phases(0)
    params = keep.trainer_memory[0].params
    assert params == 2 * keep.stage_params[0].total                         # bf16, 7.63 GiB
    assert k.rollout.total - o.rollout.total == params
    assert o.train.total == k.train.total and o.sync.total == k.sync.total   # reloaded for train and sync
    assert o.rollout.host_total - k.rollout.host_total == params             # ... into host memory meanwhile
    # the KL reference and the critic's parameters move with the policy's
    full = ("algorithm.kl_coef=0.01", *CRITIC)
    k, o = colocated(*full), colocated(*full, OFFLOAD)
    m = k.trainer_memory[0]
    assert m.reference == params and m.critic is not None
    assert k.colocated_phases(0).rollout.total - o.colocated_phases(0).rollout.total == pytest.approx(
        params + m.reference + m.critic.params)


def test_train_phase_holds_no_kv_cache_and_rollout_no_training_state():
    plan = colocated()
    m, e = plan.trainer_memory[0], plan.engine_memory
    ph = plan.colocated_phases(0)
    assert "KV" not in ph.train.gpu and "KV" not in ph.sync.gpu and ph.rollout.gpu["KV"] == e.kv_cache
    # train: the trainer's whole footprint beside the sleeping engine's runtime (context + CUDA graphs)
    assert ph.train.total == m.total + e.runtime
    # rollout: the engine's whole budget, the trainer's parameters and CUDA context; no grads, optimizer
    # state or activations, the optimizer state is in host memory
    assert ph.rollout.total == pytest.approx(e.budget + m.params + m.runtime)
    assert not {"grads", "optimizer", "activations"} & set(ph.rollout.gpu)
    assert ph.rollout.host == {"optimizer state": m.optimizer}
    # sync: both copies of the weights, no KV cache, no activations, plus the transport's buffers
    assert ph.sync.total == pytest.approx(
        e.weights + e.runtime + m.params + m.runtime + ph.sync.gpu["transport buffers"])


def test_sleep_level_changes_host_memory_not_gpu_memory():
    one, two = colocated(), colocated("cluster.colocate.sleep_level=2")
    p1, p2 = one.colocated_phases(0), two.colocated_phases(0)
    assert [ph.total for ph in p1] == [ph.total for ph in p2]
    e = one.engine_memory
    assert p1.train.host_total == e.weights and p2.train.host_total == 0   # level 1 keeps the weights on the host
    assert one.host_bytes_per_node()[0]["train"] == 8 * e.weights          # 8 engine ranks per node


def test_disk_and_cuda_ipc_sync_buffers():
    bucket, emb = 1024 * 2**20, 151936 * 4096 * 2            # weight_sync.bucket_mb=1024; V x h in bf16
    plan = colocated()
    b = plan.sync_buffers[0]
    assert b.sender == bucket + 2 * emb                      # one bucket + the embedding's TP gather
    assert b.other == 2 * emb
    assert b.engine == 0                                     # the engines read the files into their weights
    sender, other = plan.colocated_phases(0, sender=True), plan.colocated_phases(0, sender=False)
    assert sender.sync.total - other.sync.total == bucket
    # cuda_ipc: the stage's sender keeps every exported (full) tensor until the engines loaded them
    ipc = plan_for("cluster.placement=colocated", "cluster.nodes=1", "rollout.num_engines=1", "rollout.engine_tp=1",
                   "parallel.pp=1", "weight_sync.transport=cuda_ipc").sync_buffers[0]  # cuda_ipc: one engine GPU
    assert ipc.sender == 8_190_735_360 * 2 + 2 * emb and ipc.engine == 0
    # the broadcast receivers' 4 buckets in flight (disaggregated runs; the planner sizes colocated GPUs only)
    from mlrl.plan import memory as mem

    wire = mem.sync_buffers("broadcast", bucket_bytes=bucket, largest=emb, big_tensors=2)
    assert wire.engine == 4 * bucket + 2 * (emb - bucket) and wire.sender == bucket + 2 * emb


def test_overall_peak_is_the_largest_phase_and_decides_the_fit():
    plan = colocated()
    for slot, used in zip(plan.slots, plan.gpu_bytes):
        phases = plan.slot_phases(slot)
        assert used == max(ph.total for ph in phases) == phases.peak.total
    assert plan.colocated_phases(0).peak.name == "rollout"
    # 0.95 x 80 GiB for vLLM + 7.63 GiB of trainer params do not fit in the rollout phase ...
    tight = colocated("rollout.gpu_memory_utilization=0.95")
    assert not tight.fits and "peak in phase rollout" in tight.reasons[0]
    # ... with the parameters offloaded they do: 76 GiB of engine + the trainer's 1 GiB CUDA context
    offloaded = colocated("rollout.gpu_memory_utilization=0.95", OFFLOAD)
    peak = offloaded.colocated_phases(0).peak
    assert offloaded.fits and peak.name == "rollout" and peak.total == pytest.approx(77 * GIB)
    assert max(offloaded.gpu_bytes) == peak.total


def test_format_plan_lists_the_phases_for_colocated_only():
    text = format_plan(colocated())
    rollout = next(ln for ln in text.splitlines() if ln.startswith("    phase rollout: "))
    assert "(engine weights 7.63 + engine activations" in rollout and "KV 58.13 + trainer params 7.63" in rollout
    train = next(ln for ln in text.splitlines() if ln.startswith("    phase train: "))
    assert "KV" not in train and "activations 41.83" in train
    assert "    phase sync: " in text and "host memory, node 0" in text
    assert "peak 76.63 in phase rollout" in text and "result: fits (peak 76.63 of 80 GiB" in text
    disaggregated = format_plan(plan_for())
    assert "phase " not in disaggregated and "colocated GPU" not in disaggregated

"""Colocated placement on CPU, end to end (`python -m mlrl.launch cluster.placement=colocated`): real
megatron-core ranks, a real vLLM CPU server put to sleep and woken through vLLM's API every step,
the trainer's optimizer state, gradients and (offload_params) parameters offloaded and reloaded.

Run side by side with the same run in the default (disaggregated) placement: the colocated run must
learn exactly the same (rewards, losses, logprob gaps equal step for step: offload / reload is
bit-exact and sleep/wake does not change what the engines compute), and its checkpoint / HF export
of step 2, deferred to step 3's training phase, must be that of step 2.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.launching import launch, metrics

PROMPTS, SAMPLES, STEPS = 8, 8, 3
COMMON = ["--config", "launch/cpu_default.yaml", f"trainer.prompts_per_step={PROMPTS}",
          f"trainer.samples_per_prompt={SAMPLES}", f"trainer.total_steps={STEPS}", "checkpoint.save_every=2",
          "checkpoint.hf_export_every=2", "logging.progress_bar=false", "logging.plot=false"]
PHASES = ("rollout", "reward", "logprobs", "train", "sync", "eval", "checkpoint", "sleep", "reload", "offload", "wake",
          "other")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("colocated")
    colo, plain = root / "colocated", root / "disaggregated"
    # concurrently: most of a launch is its vLLM engine and trainer starting (the runs are deterministic)
    with ThreadPoolExecutor(2) as pool:
        out = pool.submit(launch, colo, *COMMON, "cluster.placement=colocated", "cluster.colocate.offload_params=true")
        base = pool.submit(launch, plain, *COMMON)
        base.result()
        return colo, plain, out.result()


def test_colocated_learns_exactly_like_disaggregated(runs):
    colo, plain, _ = runs
    a, b = metrics(colo), metrics(plain)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for x, y in zip(a, b):
        for key in ("reward/mean", "train/loss", "train/grad_norm", "train/mismatch/logprob_gap",
                    "weight_sync/canary_max_abs_diff"):
            assert x[key] == y[key], (x["step"], key, x[key], y[key])
        assert x["weight_sync/canary_max_abs_diff"] <= 1e-3


def test_per_phase_offload_and_sleep_timings(runs):
    colo, _, _ = runs
    for r in metrics(colo):
        for phase in ("sleep", "wake", "offload", "reload"):
            assert r[f"timing/{phase}"] > 0.0, (phase, r)
        total = sum(r.get(f"timing/{p}", 0.0) for p in PHASES)
        assert abs(total - r["timing/step"]) <= 0.05 * r["timing/step"]
        assert r["colocate/engine_memory_released"] == 0.0  # vLLM's CPU build keeps its memory
        assert r["colocate/sleep_level"] == 1.0
        for kind in ("params", "grads", "optimizer"):
            assert r[f"colocate/offload_bytes/{kind}"] > 0, kind
            # Megatron's optimizer creates its state at the first step: step 1 reloads none
            if kind != "optimizer" or r["step"] > 1:
                assert r[f"colocate/reload_bytes/{kind}"] == r[f"colocate/offload_bytes/{kind}"], kind
        # gradients are released, not copied; parameters and optimizer state are copied both ways
        assert r["colocate/offload_copied_bytes"] == r["colocate/offload_bytes/params"] + \
            r["colocate/offload_bytes/optimizer"]


def test_engines_went_through_vllm_sleep_and_wake(runs):
    colo, _, _ = runs
    log = (colo / "engines" / "engine-0.log").read_text()
    # one sleep and a two-stage wake (weights, then KV cache) per step, through vLLM's own endpoints,
    # and a last sleep for the end-of-run checkpoint (the trainer reloads, the engines are not woken again)
    assert log.count("seconds to fall asleep") == STEPS + 1
    assert log.count("wake up the engine with tags: ['weights']") == STEPS
    assert log.count("wake up the engine with tags: ['kv_cache']") == STEPS


def test_deferred_checkpoint_is_the_step_it_names(runs):
    colo, plain, _ = runs
    state = json.loads((colo / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["weight_version"] == 2 and state["sampler"]["consumed"] == 2 * PROMPTS
    for step in ("step_000002", "step_000003"):
        got = sorted((colo / "hf" / step).glob("*.safetensors"))
        want = sorted((plain / "hf" / step).glob("*.safetensors"))
        assert got and [p.name for p in got] == [p.name for p in want]
        assert all(g.read_bytes() == w.read_bytes() for g, w in zip(got, want)), step
    assert (colo / "checkpoints" / "latest").read_text().strip() == "step_000003"

"""A LoRA run of the whole product on CPU (`python -m mlrl.launch`, real megatron-core ranks, a real
vLLM CPU server), in both weight-sync modes:

Run A: model.lora (rank 8, all-linear) with KL to the reference (= the base, adapters off),
weight_sync.lora_mode=merged: the base with the adapters merged in is pushed over the broadcast
transport into a plain engine; checkpoint (adapters + optimizer) and HF export (merged model +
PEFT adapter folder) at the end.
Run B: resumes A's checkpoint with weight_sync.lora_mode=adapter: the engine starts with
--enable-lora and serves each new adapter version through vLLM's LoRA support; only the adapter
crosses (a PEFT folder per version); its export is the adapter folder only
(checkpoint.export_merged=false).
Asserted in both: the canary after every sync and the train/rollout logprob gap <= 1e-3 (the
engine serves exactly the trainer's policy), the engine's canary logprobs moved > 1e-2 between
syncs (it serves each new policy, not a stale one), and B's sync moves < 5% of A's bytes.
"""

import json
from pathlib import Path

import pytest
from helpers.launching import launch, metrics

COMMON = [
    "--config", "launch/cpu_default.yaml", "trainer.prompts_per_step=4", "trainer.samples_per_prompt=8",
    "logging.progress_bar=false", "rollout.startup_timeout_s=600", "model.lora.rank=8", "model.lora.alpha=16",
    "algorithm.kl_coef=0.01", "trainer.lr=2e-2",
]


def _launch(run_dir: Path, *overrides: str):
    return launch(run_dir, *COMMON, *overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    _launch(run_dir, "trainer.total_steps=2")
    a = metrics(run_dir)
    _launch(run_dir, "trainer.total_steps=4", "weight_sync.lora_mode=adapter", "weight_sync.transport=disk",
            "checkpoint.export_merged=false")
    return run_dir, a, metrics(run_dir)[len(a):]


def test_both_modes_serve_the_trainers_policy(runs):
    _, a, b = runs
    assert [r["step"] for r in a] == [1, 2] and [r["step"] for r in b] == [3, 4]
    for r in a + b:
        assert r["weight_sync/canary_max_abs_diff"] <= 1e-3, r
        assert r["train/mismatch/logprob_gap"] <= 1e-3, r
        assert r["weight_version"] == r["step"]
    # ...and the engine's policy did change at each sync: its own canary logprobs moved since the
    # previous sync by far more than the tolerance (a stale adapter, or the base, would not move)
    for run in (a, b):
        moved = [r["weight_sync/canary_moved"] for r in run if "weight_sync/canary_moved" in r]
        assert moved and min(moved) > 1e-2, moved
    # adapter mode moves the adapter only: r * (in + out) fp32 values per adapted layer (tiny-llama:
    # hidden 128, 4 x 32 query / 2 x 32 kv heads, ffn 256, 2 layers), merged mode the whole model
    h, q, kv, f, r = 128, 128, 64, 256, 8
    adapter = 2 * r * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h)) * 4
    assert {x["weight_sync/bytes"] for x in b} == {adapter}
    assert min(x["weight_sync/bytes"] for x in a) > 9 * adapter


def test_the_policy_moves_away_from_the_reference(runs):
    _, a, b = runs
    assert a[0]["train/kl"] == 0.0  # step 1 runs on B = 0: the policy is the base
    assert max(r["train/kl"] for r in a[1:] + b) > 0


def test_exports_and_checkpoints(runs):
    run_dir, _, _ = runs
    for step in (2, 4):
        export = run_dir / "hf" / f"step_{step:06d}"
        assert (export / "adapter" / "adapter_config.json").is_file()
        assert (export / "adapter" / "adapter_model.safetensors").is_file()
    # checkpoint.export_merged: A (true) wrote the merged model beside the adapter, B (false) did not
    assert (run_dir / "hf" / "step_000002" / "config.json").is_file()
    assert not (run_dir / "hf" / "step_000004" / "config.json").exists()
    export = run_dir / "hf" / "step_000004"
    cfg = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16 and sorted(cfg["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    meta = json.loads(next((run_dir / "checkpoints").glob("step_000004/*/mlrl_checkpoint.json")).read_text())
    assert meta["lora"]["rank"] == 8 and meta["lora"]["alpha"] == 16.0
    assert sorted(meta["lora"]["targets"]) == sorted(cfg["target_modules"])

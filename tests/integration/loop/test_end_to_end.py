"""The whole product on CPU: `python -m mlrl.launch` with real megatron-core ranks (gloo), a real
vLLM CPU server and weight sync every step.

Run A: 3 synchronous steps on the tiny recipe, PPO with a Megatron critic (algorithm.advantage=gae)
and 2 mini-batches per step (2 policy and 2 critic updates, behaviour logprobs once per step),
pass@k evaluation, checkpoint (policy + critic) + HF export at the end.
Run B: resumes A's checkpoint (policy and critic) and runs 3 asynchronous steps (staleness eta = 1, TIS).
Run A colocated (cluster.placement=colocated, launched alongside A): the same numbers step for step,
per-phase sleep / wake / offload / reload timings, vLLM's sleep API in the engine's log, and step 2's
checkpoint (deferred to step 3's training phase) equal to A's.
(The default GRPO path runs end to end in tests/integration/cluster.)
Asserted: train/rollout logprob gap after every sync <= 1e-3, rewards in [0, 1], every prompt's
samples accounted for, metrics / TensorBoard / plot / checkpoint / HF export written, and the
resumed run continues the step count, weight version and data position of the first.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PROMPTS, SAMPLES = 4, 4
COMMON = [
    "--config", "launch/cpu_default.yaml",
    f"trainer.prompts_per_step={PROMPTS}", f"trainer.samples_per_prompt={SAMPLES}",
    "logging.progress_bar=false", "rollout.startup_timeout_s=600",
]


# critic LR warm-up over 5 critic updates: its LR tells whether a resumed critic kept its scheduler
GAE = ["algorithm.advantage=gae", "critic.lr=1e-3", "critic.lr_warmup_steps=5"]


def _launch(run_dir: Path, *overrides: str, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mlrl.launch", *COMMON, f"logging.run_dir={run_dir}", *overrides]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    assert out.returncode == 0, f"launch failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]





def _check_steps(recs: list[dict], steps: list[int], sync_steps: set[int]) -> None:
    assert [r["step"] for r in recs] == steps
    for r in recs:
        assert 0.0 <= r["reward/mean"] <= 1.0
        # trainer vs engine on the same weights: the canary after every sync, and (on-policy steps)
        # every sampled token; async samples may be a version behind, so their gap is staleness
        assert r["weight_sync/canary_max_abs_diff"] <= 1e-3, r
        if r["step"] in sync_steps:
            assert r["train/mismatch/logprob_gap"] <= 1e-3, r
        assert r["weight_version"] == r["step"]
        # every prompt's samples are accounted for: completed + rejected + failed episodes
        assert r["groups/count"] == PROMPTS
        assert r["episodes/total"] == PROMPTS * SAMPLES
        assert r["episodes/completed"] + r["episodes/rejected"] + r["episodes/failures"] == PROMPTS * SAMPLES
        assert r["samples/trainable"] <= r["episodes/completed"]


# A learning signal that does not depend on the rewards a random policy happens to get (16 samples
# of copy_digit may all score 0): the entropy bonus has a non-zero gradient for any non-degenerate
# policy, so the first mini-batch's update always moves the policy, and the second mini-batch
# measures ratios != 1. The random-init policy is near uniform, so about half of the sampled tokens
# lie below the mean logit and gain probability from it (ratio > 1); Adam's first steps at lr 4e-3
# move the tiny model's logits by far more than eps_clip=0.02, so some ratios leave [0.98, 1.02].
# kl_in_reward: from step 2 on the KL penalty makes every return non-zero, so the critic (whose
# value head starts at exactly 0) gets a gradient whatever the rewards are.
TEETH = ["algorithm.entropy_coef=0.05", "algorithm.eps_clip=0.02", "algorithm.kl_in_reward=true"]
RUN_A = ["trainer.total_steps=3", "data.eval=synthetic:copy_digit", "data.eval_every=2", "data.num_synthetic=32",
         "trainer.mini_batches_per_step=2", "eval.samples_per_prompt=2", "checkpoint.save_every=2",
         "checkpoint.hf_export_every=2", *GAE, *TEETH]
# the colocated run also pushes its first sync in full (weight_sync.first_sync=push) where run A, a fresh
# run, lets the canary check the weights its engine loaded (auto): their metrics must still be equal
COLOCATED = ["cluster.placement=colocated", "cluster.colocate.offload_params=true", "weight_sync.first_sync=push"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run A, and the same run colocated (tests/integration/loop/test_colocated_run.py), launched
    concurrently: most of a launch is its vLLM engine and trainer ranks starting; both are deterministic."""
    root = tmp_path_factory.mktemp("e2e")
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(_launch, root / "run", *RUN_A, "eval.save_answers=true")  # (the colocated run: off)
        colo = pool.submit(_launch, root / "colocated", *RUN_A, *COLOCATED)
        return {"a": (root / "run", a.result()), "colocated": (root / "colocated", colo.result())}


@pytest.fixture(scope="module")
def run_a(runs):
    return runs["a"]


def test_sync_run(run_a):
    run_dir, out = run_a
    recs = _metrics(run_dir)
    evals = [r for r in recs if "eval/reward/mean" in r]
    assert [r["step"] for r in evals] == [2, 3]  # every 2 steps and at the end, on the held-out split
    assert all(0.0 <= r["eval/reward/mean"] <= 1.0 and r["eval/episodes/total"] == 64 for r in evals)
    assert all(0.0 <= r["eval/pass@1"] <= r["eval/pass@2"] <= 1.0 for r in evals)
    for r in evals:  # eval.save_answers: each evaluation's answers, which give its pass@1 and mean reward
        answers = [json.loads(x) for x in (run_dir / "eval" / f"step_{r['step']:06d}.jsonl").read_text().splitlines()]
        assert len(answers) == 64 and {a["prompt_index"] for a in answers} == set(range(32))
        assert sum(a["correct"] for a in answers) / 64 == pytest.approx(r["eval/pass@1"])
        assert sum(a["reward"] for a in answers) / 64 == pytest.approx(r["eval/mean_reward"])
    for r in recs:  # two updates per step; the second sees the policy the first moved (TEETH)
        assert r["train/updates"] == 2 and 0.0 < r["train/ratio_min"] <= 1.0 <= r["train/ratio_max"] < 100.0, r
        assert r["train/ratio_min"] < 1.0 or r["train/ratio_max"] > 1.0, r  # the second mini-batch is off-policy
        assert 0.0 <= r["train/clip_fraction"] <= 1.0 and r["train/approx_kl"] >= 0.0
        assert r["critic/updates"] == 2 and r["critic/value_loss"] >= 0
        # the recipe's trainer.shared_prefix_packing=auto: each group's prompt packed once (4 samples share
        # all but the last of their ~7 prompt tokens), policy and critic forwards alike
        assert r["pack/shared_prefix_saved_frac"] > 0.4, r
    # mini-batches, clipping and the critic really act: ratios above 1 and clipped tokens (TEETH), and
    # the critic's values, exactly 0 at step 1 (zero value head), have moved by step 3
    assert max(r["train/ratio_max"] for r in recs) > 1.0, [r["train/ratio_max"] for r in recs]
    assert max(r["train/clip_fraction"] for r in recs) > 0.0, [r["train/clip_fraction"] for r in recs]
    assert recs[-1]["critic/values_mean"] != 0.0 and recs[-1]["critic/value_loss"] > 0.0, recs[-1]
    # critic LR after 2, 4, 6 of its updates (linear warm-up over 5)
    assert [r["critic/lr"] for r in recs] == pytest.approx([4e-4, 8e-4, 1e-3])
    assert recs[0]["critic/values_mean"] == 0.0  # the value head starts at zero
    assert (run_dir / "checkpoints" / "step_000003" / "critic" / "mlrl_checkpoint.json").is_file()
    _check_steps(recs, [1, 2, 3], {1, 2, 3})
    assert (run_dir / "run.png").read_bytes()[:4] == b"\x89PNG"
    assert any((run_dir / "tensorboard").iterdir())
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000003"
    hf = run_dir / "hf" / "step_000003"
    assert (hf / "config.json").is_file() and list(hf.glob("*.safetensors"))
    assert "run finished: 3 steps" in out.stdout
    # where start-up went (mlrl.jobs.rl_start.StartupClock): marks in order, the concurrent starts inside them
    up = json.loads((run_dir / "startup.json").read_text())
    marks = [up[k] for k in ("launch_s", "prestart_s", "checks_s", "processes_s", "first_sync_s", "ready_s")]
    assert 0 < marks[0] and marks == sorted(marks), up
    # the engines were started gated before the checks (EnginePool.prestart): their span covers both
    assert up["processes_s"] - up["checks_s"] < up["span/engines_s"] <= up["processes_s"] - up["prestart_s"] + 1e-3
    assert 0 < up["span/trainer_s"] <= up["processes_s"] - up["checks_s"] + 1e-3


# ---- the same run colocated: engines sleep through vLLM's API while the trainer steps; the trainer
# offloads its optimizer state, gradients and parameters (policy, reference, critic) while they generate

PHASES = ("rollout", "reward", "logprobs", "train", "sync", "eval", "checkpoint", "sleep", "reload", "offload", "wake",
          "other")


def test_colocated_learns_exactly_like_disaggregated(runs):
    """Offload / reload is bit-exact and sleep / wake changes nothing the engines compute: rewards,
    losses, critic values and logprob gaps equal run A's step for step. Also: run A's first sync
    moved no bytes (the engine's own load of model.hf_dir, checked by the canary), the colocated
    run's pushed the model (first_sync=push): the engines held the same weights either way."""
    (a_dir, _), (colo, _) = runs["a"], runs["colocated"]
    first = [json.loads((d / "startup.json").read_text())["first_sync_bytes"] for d in (a_dir, colo)]
    assert first[0] == 0 and first[1] > 100_000, first
    a, b = _metrics(colo), _metrics(a_dir)[:3]  # (run A's file grows when test_resume_async continues it)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for x, y in zip(a, b):
        for key in ("reward/mean", "train/loss", "train/grad_norm", "train/mismatch/logprob_gap", "critic/value_loss",
                    "critic/values_mean", "weight_sync/canary_max_abs_diff"):
            assert x[key] == y[key], (x["step"], key, x[key], y[key])
        assert x.get("eval/reward/mean") == y.get("eval/reward/mean")
    _check_steps(a, [1, 2, 3], {1, 2, 3})
    assert not (colo / "eval").exists() and (a_dir / "eval").is_dir()  # eval.save_answers: off / on
    # the policy starts as its KL reference: the step-1 KL is the trainer's old-logprob forward against
    # the reference model's, both of model.hf_dir (algorithm.reference_hf_dir unset)
    assert b[0]["reference/kl"] == 0.0 and b[1]["reference/kl"] != 0.0


def test_colocated_per_phase_offload_and_sleep_timings(runs):
    colo, _ = runs["colocated"]
    for r in _metrics(colo):
        for phase in ("sleep", "wake", "offload", "reload"):
            assert r[f"timing/{phase}"] > 0.0, (phase, r)
        total = sum(r.get(f"timing/{p}", 0.0) for p in PHASES)
        assert abs(total - r["timing/step"]) <= 0.05 * r["timing/step"]
        assert r["colocate/engine_memory_released"] == 0.0  # vLLM's CPU build keeps its memory
        assert r["colocate/sleep_level"] == 1.0
        for kind in ("params", "grads", "optimizer"):
            assert r[f"colocate/offload_bytes/{kind}"] > 0, kind
            # Megatron's optimizers create their state at their first step: step 1 reloads none
            if kind != "optimizer" or r["step"] > 1:
                assert r[f"colocate/reload_bytes/{kind}"] == r[f"colocate/offload_bytes/{kind}"], kind
        # gradients are released, not copied; parameters and optimizer state are copied both ways
        assert r["colocate/offload_copied_bytes"] == r["colocate/offload_bytes/params"] + \
            r["colocate/offload_bytes/optimizer"]


def test_colocated_engines_went_through_vllm_sleep_and_wake(runs):
    colo, _ = runs["colocated"]
    log = (colo / "engines" / "engine-0.log").read_text()
    # a sleep at start-up (before the trainer ranks build) and the first sync's two-stage wake, then one
    # sleep and a two-stage wake (weights, then KV cache) per step through vLLM's own endpoints, and a
    # last sleep for the end-of-run checkpoint (the trainer reloads; the engines are not woken again)
    assert log.count("seconds to fall asleep") == 1 + 4
    assert log.count("wake up the engine with tags: ['weights']") == 1 + 3
    assert log.count("wake up the engine with tags: ['kv_cache']") == 1 + 3


def test_colocated_trainer_builds_after_the_engines_started_and_slept(runs):
    """mlrl.colocation's start-up order: the engines alone on the devices, then asleep, then the
    trainer ranks build (they started meanwhile, gated). Started at once, the trainer (about 5 s) was
    up seconds before the engine (about 12 s)."""
    _, (colo, _) = runs["a"], runs["colocated"]
    up = json.loads((colo / "startup.json").read_text())
    engines, trainer = up["prestart_s"] + up["span/engines_s"], up["checks_s"] + up["span/trainer_s"]
    assert trainer > engines, up


def test_colocated_deferred_checkpoint_is_the_step_it_names(runs):
    """Step 2's checkpoint / export is written in step 3's training phase: it holds step 2's state."""
    (a_dir, _), (colo, _) = runs["a"], runs["colocated"]
    state = json.loads((colo / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["weight_version"] == 2 and state["sampler"]["consumed"] == 2 * PROMPTS
    for step in ("step_000002", "step_000003"):
        got = sorted((colo / "hf" / step).glob("*.safetensors"))
        want = sorted((a_dir / "hf" / step).glob("*.safetensors"))
        assert got and [p.name for p in got] == [p.name for p in want]
        assert all(g.read_bytes() == w.read_bytes() for g, w in zip(got, want)), step
    assert (colo / "checkpoints" / "step_000002" / "critic" / "mlrl_checkpoint.json").is_file()


def test_resume_async(run_a):
    run_dir, _ = run_a
    state = json.loads((run_dir / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert state["weight_version"] == 3 and state["sampler"]["consumed"] == 3 * PROMPTS
    _launch(run_dir, "trainer.total_steps=6", "rollout.staleness=1", "algorithm.rollout_is=tis",
            "data.num_synthetic=32", *GAE)  # (the same 32 rows: the saved prompt position is one in them)
    # a resumed run's engines loaded model.hf_dir, not the checkpoint: its first sync pushes (first_sync=auto)
    assert json.loads((run_dir / "startup.json").read_text())["first_sync_bytes"] > 100_000
    recs = _metrics(run_dir)
    _check_steps(recs, [1, 2, 3, 4, 5, 6], {1, 2, 3})
    for r in recs[3:]:
        assert 0 <= r["samples/staleness_max"] <= 1  # the bound eta = 1 holds
        assert r["async/stale_dropped"] == 0
        assert r["train/updates"] == 1 and r["critic/updates"] == 1
        # the critic resumed with its scheduler (a fresh one would be at 1/5 of its LR, warming up)
        assert r["critic/lr"] == pytest.approx(1e-3)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000006"


"""A judge served in the pool, end to end: real vLLM engines for the policy AND for the judge, real
megatron-core trainer, `workflow.reward=reward_model`.

The judge is a real model with a known behaviour: the tiny Llama after `launch/sft_cpu.yaml` (20 SFT
steps) copies a digit ("copy 7" -> "7"). With the template "copy {response}", the score pattern
"^\\s*([0-9])" and max_score 9, the judge scores a policy answer d as d / 9, and an answer that is not
a digit as a failure (reward 0, counted). So the policy (random init, the copy task's prompts) can
only learn to say 9 from the judge's replies: the reward must climb, and the judge's unparsable
replies must fall, step after step.
"""

import pytest
from helpers.launching import launch, metrics

JUDGE = ("reward_model={{hf_dir: {judge}, prompt_template: 'copy {{response}}', max_tokens: 2, "
         "score_pattern: '^\\s*([0-9])', max_score: 9}}")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    launch(root / "sft", "--config", "launch/sft_cpu.yaml", "logging.progress_bar=false", "data.eval=null",
           "checkpoint.save_at_end=false")
    judge = root / "sft" / "hf" / "step_000020"
    out = launch(root / "rl", "logging.progress_bar=false", JUDGE.format(judge=judge), "workflow.reward=reward_model",
                 "trainer.total_steps=8", "checkpoint.save_at_end=false", "checkpoint.hf_export_at_end=false")
    return root / "rl", out


def test_the_policy_learns_from_the_judges_scores(run):
    run_dir, _ = run
    m = metrics(run_dir)
    assert [r["step"] for r in m] == list(range(1, 9))
    first, last = m[0]["reward/mean"], sum(r["reward/mean"] for r in m[-3:]) / 3
    assert last > first + 0.4, [r["reward/mean"] for r in m]
    assert m[-1]["reward_model/unparsed"] < m[0]["reward_model/unparsed"] / 4


def test_every_sample_is_scored_and_failures_are_recorded_per_episode(run):
    run_dir, _ = run
    for r in metrics(run_dir):
        assert r["reward_model/calls"] == r["reward_fn/calls"] == r["groups/samples"] == 512  # 64 prompts x 8
        # a reply without a score is a reward failure of that episode (reward 0), never a crash
        assert r["reward_fn/failures"] == r["reward_model/unparsed"] and r["reward_model/engine_errors"] == 0
        assert r["episodes/failures"] == 0 and r["reward_model/reply_tokens_mean"] <= 2
        assert 0 < r["timing/reward/model"] <= r["timing/rollout/phase"]


def test_the_judge_runs_on_its_own_engines(run):
    run_dir, _ = run
    judge_log = (run_dir / "reward_model" / "engines" / "engine-0.log").read_text()
    policy_log = (run_dir / "engines" / "engine-0.log").read_text()
    # two servers: the judge's serves the SFT export, the policy's the tiny Llama (synced every step)
    assert "sft/hf/step_000020" in judge_log and "sft/hf/step_000020" not in policy_log

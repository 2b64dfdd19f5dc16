"""A data mixture through `python -m mlrl.launch` on the CPU default (real megatron-core trainer,
real vLLM CPU engine): two synthetic tasks at weights 3:1, with different rewards: copy_digit's
set by data.mix[0].reward (a test reward, 1.0 for an even first token: about half of a random
model's answers, none of which copies the digit), copy_pair's its dataset's own (token_match's
partial credit), and a held-out-only source (reverse_digits: eval, no train). Each epoch's prompts
follow the weights, the held-out-only source is evaluated and never trained on, each answer is
scored by its own source's reward, and the rollout and held-out metrics are reported per source.
eval.at_start: the starting policy is evaluated first, as step 0."""

import json
from collections import Counter

import pytest
from helpers.launching import launch, metrics

from mlrl.reward.builtin import token_match_reward

PARITY = "tests.integration.evaluate.parity_reward.even_first_token"
MIX = ("data.mix=[{name: digit, train: 'synthetic:copy_digit', eval: 'synthetic:copy_digit', weight: 3, "
       f"reward: '{PARITY}'}}, "
       "{name: pair, train: 'synthetic:copy_pair', eval: 'synthetic:copy_pair', weight: 1}, "
       "{name: held, eval: 'synthetic:reverse_digits'}]")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("mix") / "run"
    # 8 rows per source: an epoch is 12 digit + 4 pair prompts = the 2 steps of 8 prompts
    launch(run, "--config", "launch/cpu_default.yaml", MIX, "data.num_synthetic=8", "data.eval_every=2",
           "trainer.prompts_per_step=8", "trainer.samples_per_prompt=4", "trainer.total_steps=2",
           "rollout.sampling.max_new_tokens=3", "eval.samples_per_prompt=2", "eval.save_answers=true",
           "eval.at_start=true",
           "checkpoint.save_at_end=false", "checkpoint.hf_export_at_end=false", "logging.progress_bar=false")
    return run


def test_each_epoch_follows_the_weights_and_metrics_are_per_source(run):
    steps = [m for m in metrics(run) if "source/digit/groups" in m or "source/pair/groups" in m]
    assert [m["step"] for m in steps] == [1, 2]
    groups = Counter()
    for m in steps:
        groups.update({s: int(m.get(f"source/{s}/groups", 0)) for s in ("digit", "pair")})
    assert groups == {"digit": 12, "pair": 4}
    assert not any(k.startswith("source/held/") for m in metrics(run) for k in m)  # never trained on
    assert all(f"source/{s}/reward/mean" in m and f"source/{s}/reward/accuracy" in m
               for m in steps for s in ("digit", "pair") if f"source/{s}/groups" in m)
    lines = metrics(run)
    assert [m["step"] for m in lines] == [0, 1, 2]  # eval.at_start: step 0 holds the starting policy's evaluation
    assert not any(k.startswith(("source/", "train/", "reward/")) for k in lines[0])
    assert sorted(p.name for p in (run / "eval").glob("*.jsonl")) == ["step_000000.jsonl", "step_000002.jsonl"]
    for line in (lines[0], lines[-1]):
        for s in ("digit", "pair", "held"):  # the held-out evaluation, per source too
            assert 0.0 <= line[f"eval/source/{s}/pass@1"] <= line[f"eval/source/{s}/pass@2"] <= 1.0
            assert f"eval/source/{s}/reward/mean" in line


def test_each_answer_is_scored_by_its_sources_reward(run):
    recs = [json.loads(x) for x in (run / "eval" / "step_000002.jsonl").read_text().splitlines()]
    assert {r["data_source"] for r in recs} == {"digit", "pair", "held"}
    assert all(r["status"] == "completed" for r in recs)
    for name in ("pair", "held"):  # token_match: copy_pair's and reverse_digits' own reward
        own = [r for r in recs if r["data_source"] == name]
        assert len(own) == 2 * 8
        assert all(r["reward"] == pytest.approx(token_match_reward("", r["response"], [], [], answer=r["answer"]))
                   for r in own)
    # digit: the parity reward (0 or 1), paying answers that do not copy the digit: neither exact_match's
    # nor token_match's score
    digit = [r for r in recs if r["data_source"] == "digit"]
    assert {r["reward"] for r in digit} == {0.0, 1.0}, [r["reward"] for r in digit]
    assert any(r["reward"] == 1.0 and r["response"].strip() != r["answer"] for r in digit)
    trained = [m["source/digit/reward/mean"] for m in metrics(run) if "source/digit/reward/mean" in m]
    assert all(0.2 <= x <= 0.8 for x in trained), trained  # about half, on the training rollouts too

"""The example workflows from AReaL's, Trinity-RFT's and rLLM's own guides (tests/unit/workflow/guide_examples/,
changed only in their imports) run through mlrl's runner and produce trainable samples."""

import json

import pytest
from _wf_helpers import last_user_word
from helpers.scripted_engine import ScriptedEngine, scripted_logprob

from mlrl.data import get_dataset
from mlrl.types import GenerationHyperparameters, Sample, TerminationReason
from mlrl.workflow import EpisodeRunner, EpisodeStatus, apply_chat_template, build_workflow
from mlrl.workflow.compat.rllm import MultiTurnWorkflow

G = GenerationHyperparameters(max_new_tokens=6)


def check_trainable(s: Sample, engine: ScriptedEngine, version: int) -> None:
    """The sample is prompt + one engine response, masked, with that response's logprobs and versions."""
    resp = next(r for r in engine.responses if list(r.input_tokens) + list(r.output_tokens) == s.tokens)
    p = len(resp.input_tokens)
    assert s.prompt_len == p and s.loss_mask == [0] * p + [1] * resp.output_len
    assert s.rollout_logprobs[p:] == pytest.approx([scripted_logprob(t, i) for i, t in enumerate(resp.output_tokens)])
    assert s.versions == [-1] * p + [version] * resp.output_len


async def run_rows(workflow, engine, rows, n):
    runner = EpisodeRunner(workflow, engine, max_concurrency=4, episode_timeout_s=30)
    try:
        return await runner.run_batch(rows, n=n), runner.last_metrics
    finally:
        await runner.aclose()


async def test_areal_single_turn_rlvr_example(tok):
    rows = list(get_dataset("synthetic:copy_digit", num_rows=3, seed=1))
    wf = build_workflow("guide_examples.areal_rlvr.RLVRWorkflow", kwargs={
        "reward_fn": "mlrl.reward.builtin.gsm8k_reward", "tokenizer": "builtin:tiny-llama"}, gconfig=G)
    eng = ScriptedEngine.from_text(tok, last_user_word, version=2)
    groups, m = await run_rows(wf, eng, rows, n=2)
    for g, row in zip(groups, rows):
        assert g.count(EpisodeStatus.COMPLETED) == 2 and g.rewards == [1.0, 1.0]
        for s in g.samples:
            check_trainable(s, eng, version=2)
            assert s.tokens[: s.prompt_len] == apply_chat_template(tok, row["messages"], add_generation_prompt=True)
    wrong = ScriptedEngine.from_text(tok, lambda p: "0" if last_user_word(p) != "0" else "1")
    groups, m = await run_rows(wf, wrong, rows, n=2)
    assert m["reward/mean"] == 0.0 and m["groups/samples"] == 6


async def test_trinity_example_workflow_with_exact_match_reward(tok, tmp_path):
    import guide_examples.trinity_example  # noqa: F401  (registers "example_workflow")

    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"question": f"copy {d}", "answer": str(d)}) + "\n" for d in (4, 8)))
    rows = list(get_dataset(str(data)))
    wf = build_workflow("example_workflow", tokenizer=tok, gconfig=G)
    eng = ScriptedEngine.from_text(tok, last_user_word, version=6)
    groups, m = await run_rows(wf, eng, rows, n=3)
    assert [g.rewards for g in groups] == [[1.0] * 3, [1.0] * 3]
    for g in groups:
        for s in g.samples:
            check_trainable(s, eng, version=6)
            assert "Question" not in tok.decode(s.tokens)  # "Question:" is outside the tiny vocabulary ...
            assert tok.unk_token_id in s.tokens[: s.prompt_len]  # ... and was sent as <unk>, as tokenized
    half = ScriptedEngine.from_text(tok, lambda p: "8")
    groups, m = await run_rows(wf, half, rows, n=2)
    assert [g.rewards for g in groups] == [[0.0, 0.0], [1.0, 1.0]] and m["reward/accuracy"] == 0.5


async def test_rllm_agent_environment_workflow(tok):
    from guide_examples.rllm_math_agent import MathAgent, SingleTurnEnvironment, exact_match_reward_fn

    wf = build_workflow(MultiTurnWorkflow, tokenizer=tok, gconfig=G, kwargs={
        "agent_cls": MathAgent, "env_cls": SingleTurnEnvironment,
        "env_args": {"reward_fn": exact_match_reward_fn}, "max_steps": 5})
    rows = [{"question": "copy 5", "ground_truth": "5"}, {"question": "copy 9", "ground_truth": "1"}]
    eng = ScriptedEngine.from_text(tok, last_user_word, version=1)
    groups, m = await run_rows(wf, eng, rows, n=2)
    assert [g.rewards for g in groups] == [[1.0, 1.0], [0.0, 0.0]]
    for g in groups:
        for e in g.episodes:
            assert e.status == EpisodeStatus.COMPLETED and e.termination_reason == TerminationReason.ENV_DONE
        for s in g.samples:
            check_trainable(s, eng, version=1)
            assert s.group_id == f"{g.group_id}:default"
    assert m["reward/accuracy"] == 0.5 and m["workflow/default_acc"] == 0.5

"""`python -m mlrl.launch --config launch/eval_cpu.yaml`: the engines alone (a real vLLM CPU server)
answer data.eval; the answers, their rewards and pass@k are checked against transformers and
against the answers file itself."""

import json
import subprocess
import sys

import pytest
import torch
from helpers.launching import ROOT, launch, metrics
from transformers import AutoModelForCausalLM, AutoTokenizer

from mlrl.data.tokenizer import apply_chat_template
from mlrl.metrics.pass_at_k import mean_pass_at_k
from mlrl.modelzoo import resolve_model_dir

PROMPTS = ["copy 3", "copy 7", "what follows 4", "add 1 and 2", "say hi", "boom", "repeat 5 5"]
NEW = 3


def _common(data):
    return ["--config", "launch/eval_cpu.yaml", "model.hf_dir=builtin:tiny-llama", f"data.eval={data}",
            f"rollout.sampling.max_new_tokens={NEW}", "logging.progress_bar=false"]


def _records(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The prompts, answered with transformers' greedy reply on even rows and with a reply no
    model gives on odd rows: a greedy evaluation must score exactly the even rows correct."""
    folder = resolve_model_dir("builtin:tiny-llama")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows, greedy = [], []
    for i, p in enumerate(PROMPTS):
        msgs = [{"role": "user", "content": p}]
        ids = torch.tensor([apply_chat_template(tok, msgs, add_generation_prompt=True)])
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.eos_token_id)[0, ids.shape[1]:]
        greedy.append(tok.decode(out, skip_special_tokens=True))
        rows.append({"messages": msgs, "answer": greedy[-1] if i % 2 == 0 else "<no model says this>"})
    path = tmp_path_factory.mktemp("eval_data") / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, greedy


def test_greedy_answers_are_transformers_and_scored_by_the_reward(tmp_path, data):
    path, greedy = data
    run, out = tmp_path / "run", tmp_path / "answers" / "greedy.jsonl"
    out.parent.mkdir()
    out.write_text("an earlier evaluation's answers\n")  # replaced whole, once the new ones are complete
    launch(run, *_common(path), "rollout.sampling.temperature=0", "eval.samples_per_prompt=1",
           f"evaluate.output={out}")
    recs = _records(out)  # evaluate.output: where the answers go (not the run folder's default)
    assert not (run / "eval_samples.jsonl").exists() and not out.with_name(out.name + ".partial").exists()
    assert [(r["prompt_index"], r["sample"]) for r in recs] == [(i, 0) for i in range(len(PROMPTS))]
    assert [r["response"] for r in recs] == greedy
    assert [r["reward"] for r in recs] == [float(i % 2 == 0) for i in range(len(PROMPTS))]
    assert [r["correct"] for r in recs] == [i % 2 == 0 for i in range(len(PROMPTS))]
    assert all(r["status"] == "completed" and 1 <= r["response_tokens"] <= NEW for r in recs)
    m = json.loads((run / "eval_metrics.json").read_text())["metrics"]
    assert m["eval/pass@1"] == m["eval/mean_reward"] == 4 / 7 and m["eval/prompts"] == 7
    assert metrics(run)[0]["step"] == 0 and metrics(run)[0]["eval/pass@1"] == 4 / 7  # also metrics.jsonl


def test_sampled_answers_give_the_pass_at_k_of_their_own_records(tmp_path, data):
    """k=4 samples of the first 6 prompts (evaluate.max_prompts), scored by a reward known from the
    tokens (first token id even): pass@1 and pass@4 equal the estimator over the written records;
    the "boom" row's reward raises in every episode, which is recorded and the evaluation goes on."""
    path, _ = data
    run = tmp_path / "run"
    out = launch(run, *_common(path), "rollout.sampling.temperature=1.0", "eval.samples_per_prompt=4",
                 "evaluate.max_prompts=6", "workflow.reward=tests.integration.evaluate.parity_reward.even_first_token")
    recs = _records(run / "eval_samples.jsonl")
    assert sorted({r["prompt_index"] for r in recs}) == list(range(6)) and len(recs) == 24
    for r in recs:
        want = 0.0 if r["prompt_index"] == 5 else None  # boom: the failed reward call scores 0.0
        assert r["reward"] in (0.0, 1.0) and (want is None or r["reward"] == want)
    per_prompt = [(4, sum(r["correct"] for r in recs if r["prompt_index"] == i)) for i in range(6)]
    m = json.loads((run / "eval_metrics.json").read_text())["metrics"]
    assert m["eval/pass@1"] == pytest.approx(mean_pass_at_k(per_prompt, 1))
    assert m["eval/pass@4"] == m["eval/pass@k"] == pytest.approx(mean_pass_at_k(per_prompt, 4))
    assert 0 < m["eval/pass@1"] < m["eval/pass@4"] <= 5 / 6  # about half correct; the boom row never
    assert m["eval/reward_fn/failures"] == 4 and m["eval/episodes/completed"] == 24
    assert "pass@4" in out.stdout


def test_an_evaluation_whose_episodes_fail_exits_1_with_its_files_written(tmp_path, data):
    """Every episode of AReaL's add-workflow fails (tests/integration/loop/test_failing_episodes):
    exit 1 with the first error, every failed answer recorded, the metrics written."""
    path, _ = data
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "mlrl.launch", *_common(path), "evaluate.max_prompts=2", "eval.samples_per_prompt=2",
           "workflow.name=tests.integration.loop.workflows.areal_add_workflow.AddWorkflow", f"logging.run_dir={run}"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, (res.returncode, res.stderr[-3000:])
    assert "the evaluation: all 4 episodes failed; the evaluation is reported as failed" in res.stderr
    assert "first failure: TypeError" in res.stderr
    recs = _records(run / "eval_samples.jsonl")
    assert len(recs) == 4 and all(r["status"] == "error" and "TypeError" in r["error"] for r in recs)
    m = json.loads((run / "eval_metrics.json").read_text())["metrics"]
    assert (m["eval/episodes/error"], m["eval/pass@1"]) == (4, 0.0)


def test_a_mix_is_answered_per_source_with_each_sources_reward(tmp_path, data):
    """data.mix: the first 4 prompts of each source (evaluate.max_prompts), greedily; the file's
    scored by workflow.reward (exact_match: the even rows), copy_digit's by its own data.mix reward
    (1.0 for any answer: the random model's wrong copies too); pass@1 per source."""
    path, _ = data
    run = tmp_path / "run"
    mix = (f"data.mix=[{{name: file, eval: '{path}'}}, {{name: digit, eval: 'synthetic:copy_digit', "
           "reward: tests.integration.evaluate.parity_reward.answered}]")
    launch(run, *_common("null"), mix, "data.num_synthetic=16", "rollout.sampling.temperature=0",
           "eval.samples_per_prompt=1", "evaluate.max_prompts=4")
    recs = _records(run / "eval_samples.jsonl")
    assert [r["data_source"] for r in recs] == ["file"] * 4 + ["digit"] * 4
    assert [r["reward"] for r in recs[:4]] == [1.0, 0.0, 1.0, 0.0]  # exact_match against the greedy replies
    assert all(r["reward"] == 1.0 for r in recs[4:]), recs[4:]  # its own reward: not exact_match's
    assert any(r["response"].strip() != r["answer"] for r in recs[4:])
    saved = json.loads((run / "eval_metrics.json").read_text())
    m = saved["metrics"]
    assert saved["data"] == f"mix(file={path}, digit=synthetic:copy_digit)"
    assert (m["eval/source/file/pass@1"], m["eval/source/digit/pass@1"], m["eval/pass@1"]) == (0.5, 1.0, 0.75)
    assert m["eval/prompts"] == 8 and m["eval/source/digit/groups"] == 4

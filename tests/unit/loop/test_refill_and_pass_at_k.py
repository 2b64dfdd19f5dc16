"""DAPO dynamic sampling refills the batch (sync and async), and pass@k evaluation, with a scripted
engine: prompts with an even digit are always answered right (a group with equal rewards: no
signal), odd digits right on every other call (an informative group)."""

import asyncio
import json
import re

import pytest
from helpers.scripted_engine import ScriptedEngine

from mlrl.config import load_config
from mlrl.data.sampler import PromptSampler
from mlrl.loop import RunContext, evaluate_at_start, evaluate_if_due, rollout_sync
from mlrl.loop_async import AsyncState, collect, produce
from mlrl.metrics import StepTimer
from mlrl.metrics.pass_at_k import mean_pass_at_k, pass_at_k
from mlrl.workflow import EpisodeRunner, build_workflow_from_config, gconfig_from_sampling, load_hf_tokenizer

P, N = 4, 2
ROWS = [{"messages": [{"role": "user", "content": f"copy {d}"}], "answer": str(d), "row": i}
        for i, d in enumerate([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9])]


def _ctx(overrides, rows=ROWS):
    cfg = load_config(
        None,
        [f"trainer.prompts_per_step={P}", f"trainer.samples_per_prompt={N}", "workflow.reward_workers=0", *overrides],
    )
    tok = load_hf_tokenizer("builtin:tiny-llama")

    def script(input_ids, call):
        digit = int(re.findall(r"copy (\d)", tok.decode(input_ids, skip_special_tokens=True))[-1])
        text = str(digit) if digit % 2 == 0 or call % 2 == 0 else "copy"
        return list(tok(text, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]

    engine = ScriptedEngine(script, eos_token_id=tok.eos_token_id, vocab_size=len(tok))
    wf = build_workflow_from_config(cfg.workflow, tokenizer=tok, gconfig=gconfig_from_sampling(cfg.rollout.sampling))
    runner = EpisodeRunner.from_config(cfg.workflow, wf, engine)
    return RunContext(cfg=cfg, policy=None, engines=engine, weight_sync=None, runner=runner,
                      sampler=PromptSampler(rows, seed=0, shuffle=False), logger=None, checkpoint=None, saves=None)


async def test_sync_refill_keeps_generating_until_the_batch_is_full():
    ctx = _ctx(["algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_rounds=4"])
    samples, m = await rollout_sync(ctx)
    # round 1: digits 0 1 2 3 (two informative), round 2: 4 5 (one), round 3: 6 (none), round 4: 7
    assert m["rollout/sampling_rounds"] == 4
    assert m["rollout/filtered_fraction"] == pytest.approx(4 / 8)
    assert m["groups/count"] == 8 and m["samples/trainable"] == P * N
    assert len({s.group_id for s in samples}) == P
    assert all(len({x.reward for x in samples if x.group_id == g}) == 2 for g in {s.group_id for s in samples})
    assert ctx.sampler.state()["consumed"] == 8


async def test_sync_refill_stops_at_max_rounds_and_trains_on_what_was_kept():
    ctx = _ctx(["algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_rounds=2"])
    samples, m = await rollout_sync(ctx)
    assert m["rollout/sampling_rounds"] == 2 and len({s.group_id for s in samples}) == 3
    assert m["rollout/filtered_fraction"] == pytest.approx(3 / 6)


async def test_without_dynamic_sampling_uniform_groups_are_kept():
    ctx = _ctx([])
    samples, m = await rollout_sync(ctx)
    assert len({s.group_id for s in samples}) == P and "rollout/sampling_rounds" not in m
    assert ctx.sampler.state()["consumed"] == P


async def test_async_refill_starts_one_more_prompt_per_dropped_group():
    ctx = _ctx(
        [
            "rollout.staleness=1",
            "algorithm.rollout_is=tis",
            "algorithm.dynamic_sampling.enabled=true",
            "algorithm.dynamic_sampling.max_rounds=4",
        ]
    )
    q: asyncio.PriorityQueue = asyncio.PriorityQueue()
    st = AsyncState()
    prod = asyncio.create_task(produce(ctx, st, q, 1))
    try:
        samples, m, stale = await asyncio.wait_for(collect(ctx, st, q, 1), 30)
    finally:
        prod.cancel()
        await asyncio.gather(prod, return_exceptions=True)
    groups = {s.group_id for s in samples}
    assert len(groups) == P and stale == 0
    assert st.extra_prompts >= 1 and m["rollout/filtered_fraction"] > 0
    assert m["rollout/sampling_rounds"] == pytest.approx(m["groups/count"] / P)
    assert all(len({x.reward for x in samples if x.group_id == g}) == 2 for g in groups)


def test_pass_at_k_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert mean_pass_at_k([(4, 1), (4, 0)], 1) == pytest.approx(0.125)
    with pytest.raises(ValueError, match="k=5 exceeds the n=4"):
        pass_at_k(4, 1, 5)


async def test_eval_reports_pass_at_1_and_pass_at_k():
    rows = ROWS[:4]  # digits 0 1 2 3: even always right, odd right every other call
    ctx = _ctx(["data.eval_every=1", "eval.samples_per_prompt=4", "trainer.total_steps=1"])
    ctx.eval_rows = rows
    m = await evaluate_if_due(ctx, 1, StepTimer())
    assert m["eval/episodes/total"] == 16
    assert m["eval/pass@1"] == pytest.approx((1 + 0.5 + 1 + 0.5) / 4)
    assert m["eval/pass@k"] == m["eval/pass@4"] == 1.0
    assert m["eval/mean_reward"] == pytest.approx(0.75)
    one = _ctx(["data.eval_every=1", "eval.samples_per_prompt=1", "trainer.total_steps=1"])
    one.eval_rows = rows
    m1 = await evaluate_if_due(one, 1, StepTimer())
    assert m1["eval/episodes/total"] == 4 and m1["eval/pass@k"] == m1["eval/pass@1"]
    strict = _ctx(
        ["data.eval_every=1", "eval.samples_per_prompt=4", "trainer.total_steps=1", "eval.correct_threshold=2.0"]
    )
    strict.eval_rows = rows
    assert (await evaluate_if_due(strict, 1, StepTimer()))["eval/pass@k"] == 0.0
    seen = []  # eval.save_answers: the run's writer gets the step and its groups
    one.eval_answers = lambda step, groups: seen.append((step, [g.data for g in groups]))
    await evaluate_if_due(one, 1, StepTimer())
    assert seen == [(1, rows)]

    def full_disk(step, groups):
        raise OSError(28, "No space left on device")

    one.eval_answers = full_disk  # a failed write is said; the step's evaluation metrics still come back
    assert (await evaluate_if_due(one, 1, StepTimer()))["eval/episodes/total"] == 4


def test_a_training_runs_eval_answers_are_written_whole(tmp_path):
    """eval.save_answers: <run_dir>/eval/step_N.jsonl, one record per episode, prompt index = row position."""
    from mlrl.jobs.rl import _eval_answers
    from mlrl.types import Sample
    from mlrl.workflow.api import EpisodeStatus
    from mlrl.workflow.runner import EpisodeResult, GroupResult

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return ",".join(map(str, ids))

    def ep(r):
        return EpisodeResult(EpisodeStatus.COMPLETED, [Sample([1, 2, 3], [0, 1, 1], [0.0] * 3, [0] * 3, reward=r,
                                                              prompt_len=1)])

    cfg = load_config(None, ["eval.correct_threshold=0.5"])
    groups = [GroupResult("a", {"answer": "x"}, [ep(1.0), ep(0.0)]), GroupResult("b", {"answer": "y"}, [ep(0.5)])]
    _eval_answers(cfg, tmp_path, Tok())(4, groups)
    recs = [json.loads(x) for x in (tmp_path / "eval" / "step_000004.jsonl").read_text().splitlines()]
    assert [(r["prompt_index"], r["sample"], r["answer"], r["response"], r["correct"]) for r in recs] == [
        (0, 0, "x", "2,3", True), (0, 1, "x", "2,3", False), (1, 0, "y", "2,3", True)]
    assert not list((tmp_path / "eval").glob("*.tmp"))


def test_a_group_short_of_k_episodes_counts_the_missing_ones_as_incorrect():
    """A group-native workflow may return fewer episodes than asked (Trinity's adapter, a run that
    yields nothing): pass@k raised "k exceeds the n samples" and the step died before its metrics."""
    from mlrl.metrics.pass_at_k import pass_metrics
    from mlrl.types import Sample
    from mlrl.workflow.runner import EpisodeResult, EpisodeStatus, GroupResult

    def done(reward):
        s = Sample(tokens=[1, 2], loss_mask=[0, 1], rollout_logprobs=[0.0, -1.0], versions=[0, 0], reward=reward)
        return EpisodeResult(EpisodeStatus.COMPLETED, samples=[s])

    full = GroupResult("a", {}, [done(1.0), done(0.0), done(0.0), done(0.0)])
    short = GroupResult("b", {}, [EpisodeResult(EpisodeStatus.REJECTED)])
    m = pass_metrics([full, short], 4, 0.5)
    assert m["eval/pass@1"] == pytest.approx((0.25 + 0.0) / 2) and m["eval/pass@4"] == pytest.approx(0.5)
    assert m["eval/mean_reward"] == pytest.approx(1.0 / 8)


class _Lines:
    """The run's metrics logger, as lines."""

    def __init__(self):
        self.lines = []

    def log(self, step, metrics):
        self.lines.append((step, dict(metrics)))


@pytest.mark.parametrize("at_start,start_step,logged", [(True, 0, True), (False, 0, False), (True, 3, False)])
async def test_eval_at_start_logs_the_starting_policys_eval_as_step_0(at_start, start_step, logged):
    """eval.at_start: a fresh run evaluates its starting policy before step 1 and logs it as step 0
    (answers as step 0 too); off, or on a resumed run, nothing happens before the first step."""
    ctx = _ctx(["data.eval_every=5", "eval.samples_per_prompt=4", "trainer.total_steps=10",
                f"eval.at_start={at_start}"])
    ctx.eval_rows, ctx.logger, ctx.state.start_step = ROWS[:4], _Lines(), start_step
    seen = []
    ctx.eval_answers = lambda step, groups: seen.append(step)
    before = ctx.state.step_end
    await evaluate_at_start(ctx)
    if not logged:
        assert ctx.logger.lines == [] and seen == [] and ctx.state.step_end == before
        return
    [(step, m)] = ctx.logger.lines
    assert step == 0 and seen == [0] and m["eval/episodes/total"] == 16
    assert m["eval/pass@1"] == pytest.approx(0.75) and m["eval/pass@4"] == 1.0 and m["timing/eval"] > 0
    assert ctx.state.step_end is not None  # step 1's wall time starts after the evaluation


async def test_the_judges_calls_of_the_start_evaluation_are_step_0s(monkeypatch):
    """workflow.reward=reward_model: what the served judge did during the step-0 evaluation is
    reported on step 0's line (read and reset there), not added to step 1's."""
    from mlrl.reward import model as judge_module

    class Judge:
        calls = 3

        def metrics(self):
            out, self.calls = {"reward_model/calls": float(self.calls)}, 0
            return out

    judge = Judge()
    monkeypatch.setattr(judge_module, "_ACTIVE", [judge])
    ctx = _ctx(["data.eval_every=5", "trainer.total_steps=10", "eval.at_start=true"])
    ctx.eval_rows, ctx.logger = ROWS[:2], _Lines()
    await evaluate_at_start(ctx)
    assert ctx.logger.lines[0][1]["reward_model/calls"] == 3.0 and judge.calls == 0

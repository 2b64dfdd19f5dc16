"""EpisodeRunner: GRPO groups, bounded concurrency, every termination path, metrics."""

import asyncio

import _runner_rewards
import pytest
from helpers.scripted_engine import ScriptedEngine

from mlrl.reward import AsyncRewardWrapper
from mlrl.types import GenerationHyperparameters, Sample, SampleStatus, StopReason, TerminationReason
from mlrl.workflow import (
    EpisodeOutput,
    EpisodeRunner,
    EpisodeStatus,
    ModelRequest,
    RolloutWorkflow,
    sample_from_response,
)

G = GenerationHyperparameters(max_new_tokens=4)


class Scripted(RolloutWorkflow):
    """Behaviour chosen by the row: ok / reject / raise / hang / inner_timeout / mutate / long."""

    def __init__(self):
        self.reward = AsyncRewardWrapper(_runner_rewards.by_row, max_workers=1, timeout=5)

    async def arun_episode(self, engine, data):
        kind = data["kind"]
        if kind == "raise":
            raise ValueError(f"bad row {data['i']}")
        if kind == "hang":
            await asyncio.sleep(60)
        if kind == "inner_timeout":
            await asyncio.wait_for(asyncio.sleep(10), timeout=0.01)
        if kind == "reject":
            return None
        if kind == "nan":  # a reward the workflow computed itself, not through mlrl's reward wrapper
            return {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "logprobs": [0.0, -0.1, -0.1],
                    "versions": [-1, 0, 0], "rewards": float("nan")}
        if kind == "short_logprobs":  # a malformed AReaL dict: 3 tokens, 2 logprobs
            return {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "logprobs": [0.0, -0.1],
                    "versions": [-1, 0, 0], "rewards": 1.0}
        if kind == "mutate":
            data["messages"].append({"role": "assistant", "content": "mutated"})
            assert len(data["messages"]) == 2, "the runner must give every episode a fresh copy of the row"
        g = G.new(max_new_tokens=2) if kind == "long" else G
        resp = await engine.agenerate(ModelRequest(input_ids=[10, 11, data["i"]], gconfig=g))
        r = await self.reward("p", "c", resp.input_tokens, resp.output_tokens, **data)
        # AReaL dict form, so the runner has to detect truncation itself.
        return {"input_ids": resp.input_tokens + resp.output_tokens, "loss_mask": [0] * 3 + [1] * resp.output_len,
                "logprobs": [0.0] * 3 + resp.output_logprobs, "versions": [-1] * 3 + resp.output_versions, "rewards": r}


def row(kind, i=0, **kw):
    return {"messages": [{"role": "user", "content": "x"}], "kind": kind, "i": i, **kw}


async def test_groups_share_ids_and_keep_row_order():
    runner = EpisodeRunner(Scripted(), ScriptedEngine(), max_concurrency=8, episode_timeout_s=10)
    groups = await runner.run_batch(
        [row("ok", 1, reward=1.0), row("ok", 2, reward=0.0), row("mutate", 3, reward=0.0)], n=3
    )
    assert [g.data["i"] for g in groups] == [1, 2, 3]
    assert len({g.group_id for g in groups}) == 3
    for g in groups:
        assert len(g.samples) == 3 and all(s.group_id == g.group_id for s in g.samples)
        assert [e.index for e in g.episodes] == [0, 1, 2]
    assert groups[0].rewards == [1.0, 1.0, 1.0] and groups[1].rewards == [0.0, 0.0, 0.0]
    m = runner.last_metrics
    assert m["episodes/total"] == 9 and m["episodes/completed"] == 9 and m["groups/samples"] == 9
    assert m["reward/mean"] == pytest.approx(1 / 3) and m["reward/accuracy"] == pytest.approx(1 / 3)
    assert m["groups/zero_std_frac"] == 1.0 and m["reward_fn/calls"] == 9


async def test_every_failure_is_recorded_and_the_batch_continues():
    runner = EpisodeRunner(Scripted(), ScriptedEngine(), max_concurrency=8, episode_timeout_s=0.5)
    rows = [row("ok", 1, reward=1.0), row("reject"), row("raise", 7), row("hang"), row("inner_timeout")]
    g_ok, g_rej, g_err, g_to, g_inner = await runner.run_batch(rows, n=2)
    assert g_ok.count(EpisodeStatus.COMPLETED) == 2
    assert g_rej.count(EpisodeStatus.REJECTED) == 2 and g_rej.samples == []
    assert g_to.count(EpisodeStatus.TIMEOUT) == 2 and g_to.episodes[0].termination_reason == TerminationReason.TIMEOUT
    err = g_err.episodes[0].info["error"]
    assert err["error_type"] == "ValueError" and err["error_message"] == "bad row 7"
    assert "arun_episode" in err["traceback"] and 'raise ValueError(f"bad row' in err["traceback"]
    assert g_err.episodes[0].termination_reason == TerminationReason.ERROR
    # A TimeoutError raised by the workflow itself is an error, not the runner's timeout.
    assert g_inner.count(EpisodeStatus.ERROR) == 2 and g_inner.episodes[0].info["error"]["error_type"] == "TimeoutError"
    m = runner.last_metrics
    assert (m["episodes/completed"], m["episodes/rejected"], m["episodes/error"], m["episodes/timeout"]) == (2, 2, 4, 2)
    assert m["episodes/failures"] == 6 and m["groups/samples"] == 2


async def test_a_non_finite_reward_fails_its_episode():
    """A NaN reward from the workflow's own result would make its whole group's advantages NaN."""
    runner = EpisodeRunner(Scripted(), ScriptedEngine(), max_concurrency=2, episode_timeout_s=10)
    (g,) = await runner.run_batch([row("nan")], n=2)
    assert g.count(EpisodeStatus.ERROR) == 2 and g.samples == []
    assert g.episodes[0].info["error"]["error_message"] == "the workflow returned a non-finite reward (nan)"


async def test_a_malformed_result_fails_its_episodes_and_the_batch_goes_on():
    """The conversion of the workflow's result raised out of run_group: the sync loop crashed, and
    the async producer's task died unseen with its prompt in flight (the step waited for it)."""
    runner = EpisodeRunner(Scripted(), ScriptedEngine(), max_concurrency=2, episode_timeout_s=10)
    g_bad, g_ok = await runner.run_batch([row("short_logprobs"), row("ok", 1, reward=1.0)], n=2)
    assert g_bad.count(EpisodeStatus.ERROR) == 2 and g_bad.samples == [] and g_ok.count(EpisodeStatus.COMPLETED) == 2
    assert "logprobs" in g_bad.episodes[0].info["error"]["error_message"]


async def test_engine_failure_and_truncation_are_seen_through_the_engine():
    def script(ids, call):
        if ids[-1] == 99:
            raise RuntimeError("engine died")
        return [4, 5, 6, 7, 2]

    runner = EpisodeRunner(Scripted(), ScriptedEngine(script), max_concurrency=4, episode_timeout_s=10)
    g_fail, g_long = await runner.run_batch([row("ok", 99), row("long", 1)], n=1)
    assert g_fail.episodes[0].status == EpisodeStatus.ERROR
    assert "engine died" in g_fail.episodes[0].info["error"]["error_message"]
    (s,) = g_long.samples
    assert s.status == SampleStatus.TRUNCATED and runner.last_metrics["response/truncated_frac"] == 1.0


async def test_reward_function_failures_are_counted_per_episode():
    runner = EpisodeRunner(Scripted(), ScriptedEngine(), max_concurrency=4, episode_timeout_s=10)
    (g,) = await runner.run_batch([row("ok", 1, reward="fail")], n=3)
    assert g.count(EpisodeStatus.COMPLETED) == 3 and g.rewards == [0.0] * 3
    assert all(e.reward_stats.failures == 1 for e in g.episodes)
    assert runner.last_metrics["reward_fn/failures"] == 3


async def test_concurrency_is_bounded():
    state = {"now": 0, "peak": 0}

    class Slow(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
            await asyncio.sleep(0.02)
            state["now"] -= 1
            return Sample(tokens=[1, 2], loss_mask=[0, 1], rollout_logprobs=[0, -1], versions=[-1, 0], reward=1.0)

    runner = EpisodeRunner(Slow(), ScriptedEngine(), max_concurrency=3, episode_timeout_s=10)
    groups = await runner.run_batch([row("ok", i) for i in range(4)], n=4)
    assert sum(len(g.samples) for g in groups) == 16 and state["peak"] == 3


async def test_group_native_workflows_and_metrics_passthrough():
    class Grouped(RolloutWorkflow):
        group_native = True
        calls = 0

        async def arun_episode(self, engine, data):
            raise AssertionError("group-native workflows are called once per prompt")

        async def arun_group(self, engine, data, n):
            Grouped.calls += 1
            outs = []
            for i in range(n):
                resp = await engine.agenerate(ModelRequest(input_ids=[3, i], gconfig=G))
                outs.append(EpisodeOutput(samples=[sample_from_response(resp, float(i))], metrics={"turns": float(i)}))
            return outs

    runner = EpisodeRunner(Grouped(), ScriptedEngine(), max_concurrency=2, episode_timeout_s=10)
    (g,) = await runner.run_batch([row("ok")], n=4)
    assert Grouped.calls == 1 and len(g.episodes) == 4 and g.rewards == [0.0, 1.0, 2.0, 3.0]
    assert runner.last_metrics["workflow/turns"] == 1.5 and runner.last_metrics["reward/accuracy"] == 0.75


def test_runner_argument_checks():
    with pytest.raises(TypeError, match="no arun_episode"):
        EpisodeRunner(object(), ScriptedEngine())
    with pytest.raises(ValueError, match="max_concurrency"):
        EpisodeRunner(Scripted(), ScriptedEngine(), max_concurrency=0)


async def test_error_stop_reason_from_a_direct_call_is_an_episode_error():
    class Direct(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            resp = await engine.agenerate(ModelRequest(input_ids=[1], gconfig=G))
            assert resp.stop_reason == StopReason.ERROR
            return sample_from_response(resp, 1.0)

    runner = EpisodeRunner(Direct(), ScriptedEngine(lambda ids, c: 1 / 0), episode_timeout_s=10)
    e = await runner.run_episode(row("ok"))
    assert e.status == EpisodeStatus.ERROR and "ZeroDivisionError" in e.info["error"]["error_message"]


async def test_batch_result_evaluation_flag_and_prefix(tok):
    from _wf_helpers import last_user_word

    from mlrl.workflow import BatchResult, is_evaluation
    from mlrl.workflow.builtin.rlvr import RLVRWorkflow

    seen = []

    class Probe(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            seen.append(is_evaluation())
            return Sample(
                tokens=[1, 2], loss_mask=[0, 1], rollout_logprobs=[0, -1], versions=[-1, 0], reward=float(data["i"])
            )

    runner = EpisodeRunner(Probe(), ScriptedEngine(), episode_timeout_s=10)
    batch = await runner.run_batch([row("ok", 1), row("ok", 0)], n=2)
    assert isinstance(batch, BatchResult) and len(batch) == 2 and [s.reward for s in batch.samples] == [1, 1, 0, 0]
    assert batch.metrics == runner.last_metrics and batch[0].metrics["reward/mean"] == 1.0
    ev = await runner.run_batch([row("ok", 0)], n=1, evaluation=True)
    assert seen == [False] * 4 + [True] and runner.last_metrics == batch.metrics and ev.metrics["reward/mean"] == 0.0
    pre = EpisodeRunner(Probe(), ScriptedEngine(), metric_prefix="rollout")
    assert "rollout/reward/mean" in (await pre.run_batch([row("ok", 1)], n=1)).metrics

    greedy = G.new(temperature=0.0, greedy=True)
    wf = RLVRWorkflow("exact_match", G, tok, reward_workers=1, eval_gconfig=greedy)
    eng = ScriptedEngine.from_text(tok, last_user_word)
    r2 = EpisodeRunner(wf, eng, episode_timeout_s=10)
    msgs = {"messages": [{"role": "user", "content": "copy 1"}], "answer": "1"}
    await r2.run_batch([msgs], n=1)
    await r2.run_batch([msgs], n=1, evaluation=True)
    assert [r.gconfig.greedy for r in eng.requests] == [False, True]


class TwoCalls(RolloutWorkflow):
    """Two requests per episode (a multi-turn shape), so per-call seeds are exercised too."""

    async def arun_episode(self, engine, data):
        a = await engine.agenerate(ModelRequest(input_ids=[10, data["i"]], gconfig=G))
        b = await engine.agenerate(ModelRequest(input_ids=a.input_tokens + a.output_tokens, gconfig=G))
        return Sample(
            tokens=b.input_tokens + b.output_tokens,
            loss_mask=[0, 0] + [1] * (len(b.input_tokens) - 2 + b.output_len),
            rollout_logprobs=[0.0] * (len(b.input_tokens) + b.output_len),
            versions=[-1] * (len(b.input_tokens) + b.output_len),
            reward=1.0,
        )


async def _request_seeds(seed, max_concurrency, version=0, rows=(0, 1, 2), eval_first=False):
    eng = ScriptedEngine(version=version)
    runner = EpisodeRunner(TwoCalls(), eng, max_concurrency=max_concurrency, episode_timeout_s=10, seed=seed)
    if eval_first:  # an evaluation at this version before the training rollout takes its own slots
        await runner.run_batch([row("ok", 9)], n=2, evaluation=True)
        eng.requests.clear()
    await runner.run_batch([row("ok", i) for i in rows], n=2)
    # key each request by (prompt, call) so that the completion order does not matter
    return sorted((tuple(r.input_ids[:2]), len(r.input_ids) > 2, r.gconfig.seed) for r in eng.requests)


async def test_per_request_seeds_are_a_function_of_the_run_seed_step_group_and_call():
    a = await _request_seeds(seed=7, max_concurrency=6)
    b = await _request_seeds(seed=7, max_concurrency=1)          # other batching and order: the same seeds
    assert a == b
    seeds = [s for *_, s in a]
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds) and len(set(seeds)) == len(seeds) == 12
    other = [s for *_, s in await _request_seeds(seed=8, max_concurrency=6)]
    assert not set(other) & set(seeds)                            # another run seed: other samples
    later = [s for *_, s in await _request_seeds(seed=7, max_concurrency=6, version=3)]
    assert not set(later) & set(seeds)                            # the next step re-samples the same rows afresh
    assert {s for *_, s in await _request_seeds(seed=None, max_concurrency=6)} == {None}  # off: the engine's RNG
    # the same prompt twice in one step (few distinct rows): the two groups sample differently
    dup = [s for *_, s in await _request_seeds(seed=7, max_concurrency=6, rows=(0, 0, 0))]
    assert len(set(dup)) == 12
    # evaluation counts its own groups: a run that evaluated first trains on the same seeds
    assert await _request_seeds(seed=7, max_concurrency=6, eval_first=True) == a

"""The served judge (`reward_model`) without engines: what the judge is asked (its template in its
chat template), how its reply becomes a reward, what a bad reply or a failed engine gives (a
counted failure of that episode, never a crash), coroutine rewards in the wrapper (timeout,
concurrency), and the config checks. The judge on real vLLM engines: tests/integration/reward."""

import asyncio
import time
from pathlib import Path

import pytest

from mlrl.config import ConfigError, load_config, validate
from mlrl.reward import AsyncRewardWrapper, collect_reward_stats, get_reward_fn
from mlrl.reward.model import JudgeError, ModelJudge, active_judge, set_active_judge
from mlrl.types import ModelResponse, StopReason
from mlrl.workflow import load_hf_tokenizer


class ScriptedEngine:
    """A stand-in for the judge's engines (unit test): answers each prompt from a script of token ids."""

    def __init__(self, tokenizer, replies: dict[str, str], delay: float = 0.0, fail: bool = False):
        self.tok, self.replies, self.delay, self.fail = tokenizer, replies, delay, fail
        self.requests = []
        self.in_flight = self.max_in_flight = 0

    async def agenerate(self, req):
        self.requests.append(req)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        if self.fail:
            return ModelResponse(input_tokens=req.input_ids, stop_reason=StopReason.ERROR, error="engine died")
        prompt = self.tok.decode(req.input_ids)
        reply = next((r for k, r in self.replies.items() if k in prompt), "no idea")
        return ModelResponse(input_tokens=req.input_ids, output_tokens=self.tok(reply, add_special_tokens=False)[
            "input_ids"])


@pytest.fixture(scope="module")
def tok():
    return load_hf_tokenizer("builtin:tiny-llama")


def _judge(tok, engine, **kw):
    args = dict(prompt_template="copy {response}", score_pattern=r"^\s*([0-9])", max_score=9.0, max_tokens=2)
    args.update(kw)
    return ModelJudge(engine, tok, **args)


async def test_the_judge_is_asked_in_its_chat_template_and_its_reply_is_the_reward(tok):
    engine = ScriptedEngine(tok, {"copy 7": "7 .", "copy 3": "3 ."})
    judge = _judge(tok, engine)
    assert await judge.score("copy 2", "7") == pytest.approx(7 / 9)
    assert await judge.score("copy 2", "3") == pytest.approx(3 / 9)
    req = engine.requests[0]
    assert tok.decode(req.input_ids) == "user : copy 7 . assistant :"  # one user turn + generation prompt
    assert req.gconfig.greedy and req.gconfig.max_new_tokens == 2
    assert judge.metrics() == {"reward_model/calls": 2.0, "reward_model/unparsed": 0.0,
                               "reward_model/engine_errors": 0.0, "reward_model/reply_tokens_mean": 2.0}
    assert judge.metrics()["reward_model/calls"] == 0.0  # metrics are per step: read and reset


async def test_template_placeholders_question_and_answer(tok):
    engine = ScriptedEngine(tok, {})
    judge = _judge(tok, engine, prompt_template="{question} {answer} {response}")
    with pytest.raises(JudgeError):
        await judge.score("add 3 4", "8", answer=7)
    assert tok.decode(engine.requests[0].input_ids) == "user : add 3 4 7 8 . assistant :"


async def test_a_reply_without_a_score_or_a_failed_engine_is_a_counted_episode_failure(tok):
    set_active_judge(_judge(tok, ScriptedEngine(tok, {"copy 5": "5"})))
    try:
        w = AsyncRewardWrapper(get_reward_fn("reward_model"), timeout=5)
        with collect_reward_stats() as st:
            got = await w.score_many([(("p", "5", [], []), {"messages": [{"role": "user", "content": "copy 1"}]}),
                                      (("p", "hello", [], []), {})])
        assert got == [pytest.approx(5 / 9), 0.0]
        assert st.calls == 2 and st.failures == 1 and st.timeouts == 0
        assert active_judge().metrics()["reward_model/unparsed"] == 1.0
        set_active_judge(_judge(tok, ScriptedEngine(tok, {}, fail=True)))
        with collect_reward_stats() as st:
            assert await w("p", "5", [], []) == 0.0
        assert st.failures == 1 and active_judge().metrics()["reward_model/engine_errors"] == 1.0
    finally:
        set_active_judge(None)


async def test_without_a_served_judge_the_reward_fails_clearly(caplog):
    w = AsyncRewardWrapper(get_reward_fn("reward_model"), timeout=5)
    assert await w("p", "c", [], []) == 0.0 and w.stats.failures == 1
    assert "no reward model is running" in caplog.text


async def test_coroutine_rewards_run_concurrently_on_the_loop_with_their_timeout(tok):
    engine = ScriptedEngine(tok, {"copy 9": "9"}, delay=0.3)
    set_active_judge(_judge(tok, engine))
    try:
        w = AsyncRewardWrapper(get_reward_fn("reward_model"), timeout=5, max_workers=2)  # no pool for coroutines
        t0 = time.perf_counter()
        got = await w.score_many([(("p", "9", [], []), {})] * 8)
        assert got == [1.0] * 8 and engine.max_in_flight == 8  # one batch of concurrent calls, not 8 x 0.3 s
        assert time.perf_counter() - t0 < 1.5
        slow = AsyncRewardWrapper(get_reward_fn("reward_model"), timeout=0.1)
        with collect_reward_stats() as st:
            assert await slow("p", "9", [], []) == 0.0
        assert st.timeouts == 1 and st.failures == 0
    finally:
        set_active_judge(None)


def test_the_judge_refuses_a_pattern_without_a_group(tok):
    with pytest.raises(ValueError, match="needs a group"):
        _judge(tok, ScriptedEngine(tok, {}), score_pattern=r"\d")


JUDGE = "reward_model={hf_dir: builtin:tiny-llama}"
RECIPE = Path(__file__).resolve().parents[3] / "launch" / "cpu_default.yaml"


@pytest.mark.parametrize("overrides, message", [
    ([JUDGE], "reward_model: the served judge scores only through workflow.reward=reward_model"),
    (["workflow.reward=reward_model"], "workflow.reward=reward_model scores with a served judge: add a reward_model"),
    ([JUDGE, "workflow.reward=reward_model", "reward_model.kind=scalar"], "reward_model.kind='scalar': expected"),
    ([JUDGE, "workflow.reward=reward_model", "reward_model.kind=classifier", "reward_model.max_tokens=4"],
     "reward_model.max_tokens: a generative judge's setting"),
    (["reward_model={num_engines: 1}", "workflow.reward=reward_model"], "reward_model.hf_dir: .* is required"),
    ([JUDGE, "workflow.reward=reward_model", "reward_model.num_engines=0"], "reward_model.num_engines"),
    ([JUDGE, "workflow.reward=reward_model", "reward_model.score_pattern='[0-9]'"], "needs a group capturing"),
    ([JUDGE, "workflow.reward=reward_model", "reward_model.score_pattern=(["], "not a regular expression"),
    ([JUDGE, "workflow.reward=reward_model", "reward_model.prompt_template={question} {verdict}"],
     "reward_model.prompt_template: KeyError 'verdict'"),
    ([JUDGE, "workflow.reward=reward_model", "reward_model.max_score=0"], "reward_model.max_score=0.0"),
    ([JUDGE, "workflow.reward=reward_model", "cluster.nodes=2", "cluster.gpus_per_node=8"],
     "placed on one machine for now"),
])
def test_config_checks(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(RECIPE, overrides), dry_run=True)


def test_the_judges_gpus_are_taken_from_the_trainers():
    from mlrl.plan import format_plan, make_plan

    base = ["cluster.gpus_per_node=8", "rollout.num_engines=2", "rollout.engine_tp=2"]
    plain = validate(load_config(RECIPE, base), dry_run=True)
    cfg = load_config(RECIPE, [*base, "reward_model={hf_dir: builtin:tiny-llama, num_engines: 1, engine_tp: 2}",
                             "workflow.reward=reward_model"])
    layout = validate(cfg, dry_run=True)
    assert plain.trainer_devices == 4 and layout.trainer_devices == 2 and layout.rollout_devices == 6
    plan = make_plan(cfg, layout)
    judges = [s for s in plan.slots if s.engine is not None and s.engine.engine >= 2]
    assert len(judges) == 2 and not any(s.trainer for s in judges)
    assert "(judge)" in format_plan(plan) and "judge    reward_model builtin:tiny-llama" in format_plan(plan)
    with pytest.raises(ConfigError, match="reward_model.engine_tp=1"):
        validate(load_config(RECIPE, [*base, "reward_model={hf_dir: builtin:tiny-llama}",
                                    "workflow.reward=reward_model"]), dry_run=True)


def test_the_judges_engine_fields_reach_its_servers(monkeypatch):
    """Each engine field of reward_model changes the judge's server (two values each), and none of
    the policy's: the judge's pool is built from `RewardModelConfig.engines(rollout)`."""
    from mlrl.config.schema import RewardModelConfig, RolloutConfig
    from mlrl.rollout import server

    rollout = RolloutConfig(num_engines=3, engine_tp=1, cpu_kv_cache_gb=1.0, max_model_len=256)

    def launch(rm: RewardModelConfig, gpu: bool) -> tuple[list[str], dict[str, str], int]:
        monkeypatch.setattr(server, "_on_gpu", lambda: gpu)
        cfg = rm.engines(rollout)
        spec = server.ServerSpec.from_config(cfg, "engine-0", "/judge", "float32", "t")
        return server.server_command(spec, 1), server.server_env(spec, {}), cfg.num_engines

    a = launch(RewardModelConfig(hf_dir="/judge", num_engines=1, cpu_kv_cache_gb=2.0, max_model_len=128), False)
    b = launch(RewardModelConfig(hf_dir="/judge", num_engines=2, cpu_kv_cache_gb=4.0, max_model_len=512), False)
    assert (a[2], b[2]) == (1, 2)  # not the rollout's 3
    assert (a[1]["VLLM_CPU_KVCACHE_SPACE"], b[1]["VLLM_CPU_KVCACHE_SPACE"]) == ("2", "4")
    assert "128" in a[0] and "512" in b[0] and "256" not in a[0] + b[0]
    tp = launch(RewardModelConfig(hf_dir="/judge", engine_tp=2), False)[0]
    assert tp[tp.index("--tensor-parallel-size") + 1] == "2"
    g1 = launch(RewardModelConfig(hf_dir="/judge", gpu_memory_utilization=0.5), True)[0]
    g2 = launch(RewardModelConfig(hf_dir="/judge", gpu_memory_utilization=0.7), True)[0]
    flag = "--gpu-memory-utilization"
    assert g1[g1.index(flag) + 1] == "0.5" and g2[g2.index(flag) + 1] == "0.7"


def test_the_verdict_is_the_last_score_and_must_lie_on_the_scale(tok):
    """A judge that reasons first names numbers before its verdict (the first one was taken), and a
    score off the 0..max_score scale became a reward above 1 or below 0."""
    from mlrl.config.schema import RewardModelConfig

    d = RewardModelConfig()  # the default template and pattern ("score: N")
    judge = ModelJudge(ScriptedEngine(tok, {}), tok, prompt_template=d.prompt_template, score_pattern=d.score_pattern,
                       max_score=10.0)
    assert judge.parse("I would score 2 points for style, but overall. Score: 9") == pytest.approx(0.9)
    assert judge.parse("Score: 10/10") == pytest.approx(1.0)
    for reply in ("Score: 85", "Score: 100/100", "score=-3"):
        with pytest.raises(JudgeError, match=r"is outside \[0, reward_model.max_score=10\]"):
            judge.parse(reply)

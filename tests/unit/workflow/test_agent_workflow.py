"""openai_agent: agents written against AsyncOpenAI become trainable samples through the proxy."""

import copy

import openai
import pytest
from _wf_helpers import last_user_word
from helpers.scripted_engine import ScriptedEngine

from mlrl.types import GenerationHyperparameters
from mlrl.workflow import EpisodeRunner, EpisodeStatus, build_workflow
from mlrl.workflow.builtin.agent import OpenAIAgentWorkflow

G = GenerationHyperparameters(max_new_tokens=6)
ROW = {"messages": [{"role": "user", "content": "copy 7"}], "answer": "7"}
SEEN_CLIENTS = []


class TwoTurnAgent:
    """Asks, then asks again with the first answer in the history; rewards the final answer."""

    async def run(self, data, **extra_kwargs):
        SEEN_CLIENTS.append(extra_kwargs["http_client"])
        client = openai.AsyncOpenAI(base_url=extra_kwargs["base_url"], api_key=extra_kwargs["api_key"],
                                    http_client=extra_kwargs["http_client"], max_retries=0)
        msgs = list(data["messages"])
        first = await client.chat.completions.create(model="default", messages=msgs)
        msgs += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "copy 7"},
        ]
        second = await client.chat.completions.create(model="default", messages=msgs)
        return float(second.choices[0].message.content == data["answer"])


class DictRewardAgent:
    async def run(self, data, **kw):
        c = openai.AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw["http_client"])
        a = await c.chat.completions.create(model="default", messages=data["messages"])
        b = await c.chat.completions.create(model="default", messages=data["messages"])
        return {a.id: 0.25, b.id: 0.75}


class SilentAgent:
    async def run(self, data, **kw):
        c = openai.AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw["http_client"])
        await c.chat.completions.create(model="default", messages=data["messages"])


class NoCallAgent:
    async def run(self, data, **kw):
        return 1.0


class CrashingAgent:
    async def run(self, data, **kw):
        raise KeyError("tool not found")


async def run(tok, agent, engine, n=2, **kw):
    wf = build_workflow(agent, kwargs=kw, tokenizer=tok, gconfig=G, reward="exact_match", reward_workers=1)
    runner = EpisodeRunner(wf, engine, max_concurrency=4, episode_timeout_s=20)
    try:
        (g,) = await runner.run_batch([ROW], n=n)
    finally:
        await runner.aclose()
    return g, runner.last_metrics


async def test_multi_turn_agent_becomes_discounted_samples(tok):
    eng = ScriptedEngine.from_text(tok, last_user_word, version=4)
    SEEN_CLIENTS.clear()
    g, m = await run(tok, TwoTurnAgent, eng, n=2, turn_discount=0.5)
    assert g.count(EpisodeStatus.COMPLETED) == 2 and len(g.samples) == 4
    assert [s.reward for s in g.samples] == [0.5, 1.0, 0.5, 1.0]
    second = g.samples[1]
    assert (
        tok.decode(second.tokens[: second.prompt_len]) == "user : copy 7 . assistant : 7 . user : copy 7 . assistant :"
    )
    for s in g.samples:
        resp = next(r for r in eng.responses if r.input_tokens + r.output_tokens == s.tokens)
        assert (
            s.versions[s.prompt_len :] == [4] * resp.output_len
            and s.rollout_logprobs[s.prompt_len :] == resp.output_logprobs
        )
    assert len(SEEN_CLIENTS) == 2 and SEEN_CLIENTS[0] is SEEN_CLIENTS[1]
    assert m["workflow/num_model_calls"] == 2.0 and m["reward/accuracy"] == 1.0


async def test_dict_rewards_and_reward_function_fallback(tok):
    g, _ = await run(tok, DictRewardAgent, ScriptedEngine.from_text(tok, last_user_word), n=1)
    assert [s.reward for s in g.samples] == [0.25 + 0.75, 0.75]  # discount 1.0 propagates backward
    g2, m2 = await run(tok, SilentAgent, ScriptedEngine.from_text(tok, last_user_word), n=2)
    assert g2.rewards == [1.0, 1.0] and m2["reward_fn/calls"] == 2
    g3, _ = await run(tok, SilentAgent, ScriptedEngine.from_text(tok, lambda p: "3"), n=1)
    assert g3.rewards == [0.0]


async def test_rejected_and_failed_agent_episodes(tok):
    g, _ = await run(tok, NoCallAgent, ScriptedEngine(), n=1)
    assert (
        g.episodes[0].status == EpisodeStatus.REJECTED
        and g.episodes[0].info["reason"] == "the agent made no model call"
    )
    g2, _ = await run(tok, CrashingAgent, ScriptedEngine(), n=1)
    err = g2.episodes[0].info["error"]
    assert (
        g2.episodes[0].status == EpisodeStatus.ERROR
        and err["error_type"] == "KeyError"
        and "tool not found" in err["traceback"]
    )


async def test_concat_export(tok):
    eng = ScriptedEngine.from_text(tok, last_user_word)
    g, _ = await run(tok, TwoTurnAgent, eng, n=1, export_style="concat")
    # the tiny chat template re-renders "7 </s>" as "7 ." in the history, so the second call does not extend
    # the first token for token: concat falls back to two separate samples
    assert len(g.samples) == 2


# Two chat templates over the tiny vocabulary. The model "reasons" in parentheses before its answer
# and ends with EOS. APPEND_ONLY renders an earlier assistant turn exactly as the model produced it
# (EOS included), so every next prompt extends the previous prompt + completion token for token.
# DROPS_REASONING renders earlier assistant turns without their "( ... )" part, as Qwen3's template
# drops earlier <think> blocks: the next prompt no longer extends what the engine produced.
_TURN = "{{ m['role'] }} : {{ %s }}{%% if m['role'] == 'assistant' %%} </s> {%% else %%} . {%% endif %%}"
_GEN = "{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}"
APPEND_ONLY = "{% for m in messages %}" + _TURN % "m['content']" + _GEN
DROPS_REASONING = ("{% for m in messages %}" + _TURN % "m['content'].split(')')[-1] | trim" + _GEN)


@pytest.mark.parametrize("template, samples, splits", [(APPEND_ONLY, 1, 0), (DROPS_REASONING, 2, 1)])
async def test_multi_turn_tokens_are_the_engines_own_with_any_template(tok, template, samples, splits):
    """Token in, token out: every concat sample is exactly what the engine saw and produced. With a
    template that re-renders the history differently the episode is split where the tokens stop
    extending each other (and the split is counted); with an append-only one it is one sample."""
    t = copy.deepcopy(tok)
    t.chat_template = template
    eng = ScriptedEngine.from_text(t, lambda p: "( a b ) " + last_user_word(p))
    g, m = await run(t, TwoTurnAgent, eng, n=1, export_style="concat")
    assert [e.status for e in g.episodes] == [EpisodeStatus.COMPLETED] and len(g.samples) == samples
    assert m["workflow/num_template_splits"] == splits
    r1, r2 = eng.responses
    first_seq = r1.input_tokens + r1.output_tokens
    assert (r2.input_tokens[: len(first_seq)] == first_seq) == (splits == 0)
    if samples == 1:  # one sequence: both completions trained, the history between them is not
        (s,) = g.samples
        assert s.tokens == r2.input_tokens + r2.output_tokens
        assert [i for i, x in enumerate(s.loss_mask) if x] == (
            [*range(len(r1.input_tokens), len(first_seq)), *range(len(r2.input_tokens), len(s.tokens))])
    else:
        assert [s.tokens for s in g.samples] == [first_seq, r2.input_tokens + r2.output_tokens]
        for s, r in zip(g.samples, (r1, r2)):
            assert s.prompt_len == len(r.input_tokens) and sum(s.loss_mask) == r.output_len
            assert s.rollout_logprobs[s.prompt_len:] == r.output_logprobs
    assert "( a b )" not in t.decode(r2.input_tokens) or splits == 0  # the dropped reasoning really is gone


def test_agent_argument_checks(tok):
    with pytest.raises(TypeError, match="async def run"):
        OpenAIAgentWorkflow(object(), tok)
    with pytest.raises(ValueError, match="export_style"):
        OpenAIAgentWorkflow(TwoTurnAgent(), tok, export_style="tree")


class HotAgent:
    """Asks at its own temperature and top_p, as agents written for chat APIs often do."""

    async def run(self, data, **kw):
        c = openai.AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw["http_client"])
        await c.chat.completions.create(model="default", messages=data["messages"], temperature=0.2, top_p=0.5,
                                        max_tokens=3)
        return 1.0


@pytest.mark.parametrize("overrides", [False, True])
async def test_agents_sample_at_the_policys_temperature_unless_overrides_are_on(tok, overrides, caplog):
    """The trainer's logprobs use rollout.sampling's temperature over the whole softmax: a request's
    own temperature / top_p makes its sample off-policy, so by default they are ignored (max_tokens
    still applies); sampling_overrides=true lets them through, with a warning."""
    eng = ScriptedEngine.from_text(tok, last_user_word)
    g, _ = await run(tok, HotAgent, eng, n=1, sampling_overrides=overrides)
    assert g.count(EpisodeStatus.COMPLETED) == 1
    got = eng.requests[0].gconfig
    want = (0.2, 0.5) if overrides else (G.temperature, G.top_p)
    assert (got.temperature, got.top_p, got.max_new_tokens) == (*want, 3)
    assert ("off-policy" in caplog.text) == overrides

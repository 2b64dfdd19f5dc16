"""The recording OpenAI-compatible proxy, driven by the real `openai.AsyncOpenAI` client."""

import asyncio

import aiohttp
import httpcore
import httpx2
import openai
import pytest
from _wf_helpers import count_calls, last_user_word
from helpers.scripted_engine import ScriptedEngine, scripted_logprob

from mlrl.types import GenerationHyperparameters, ModelResponse
from mlrl.workflow import apply_chat_template
from mlrl.workflow.agent_proxy.interactions import Interaction, InteractionLog
from mlrl.workflow.agent_proxy.proxy import OpenAIProxy, shared_http_client

MSGS = [{"role": "user", "content": "copy 7"}]


@pytest.fixture
async def proxy(tok):
    p = OpenAIProxy(tok, default_gconfig=GenerationHyperparameters(max_new_tokens=8, temperature=1.0))
    await p.start()
    yield p
    await p.aclose()


def client(session):
    return openai.AsyncOpenAI(
        base_url=session.base_url, api_key=session.api_key, http_client=shared_http_client(), max_retries=0
    )


async def test_chat_completion_records_exact_tokens_logprobs_versions(proxy, tok):
    eng = ScriptedEngine.from_text(tok, last_user_word, version=3)
    s = proxy.start_session(eng)
    out = await client(s).chat.completions.create(model="m", messages=MSGS, logprobs=True)
    assert out.choices[0].message.content == "7" and out.choices[0].finish_reason == "stop"
    (inter,) = list(s.log)
    resp = eng.responses[0]
    assert inter.id == out.id and inter.model_response is resp
    assert resp.input_tokens == apply_chat_template(tok, MSGS, add_generation_prompt=True)
    assert out.model_extra["prompt_token_ids"] == resp.input_tokens
    assert out.choices[0].model_extra["token_ids"] == resp.output_tokens
    assert [c.logprob for c in out.choices[0].logprobs.content] == [
        scripted_logprob(t, i) for i, t in enumerate(resp.output_tokens)
    ]
    assert resp.output_versions == [3] * len(resp.output_tokens)
    assert inter.messages == MSGS and inter.text == "7"
    assert out.usage.prompt_tokens == len(resp.input_tokens) and out.usage.completion_tokens == len(resp.output_tokens)


async def test_concurrent_sessions_do_not_mix(proxy, tok):
    eng = ScriptedEngine.from_text(tok, last_user_word, delay_s=0.01)
    sessions = [proxy.start_session(eng) for _ in range(6)]

    async def talk(s, d):
        c = client(s)
        for _ in range(2):
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": f"copy {d}"}])

    await asyncio.gather(*(talk(s, d) for d, s in enumerate(sessions)))
    for d, s in enumerate(sessions):
        assert len(s.log) == 2 and all(i.text == str(d) for i in s.log)


async def test_sampling_parameters_reach_the_engine(proxy, tok):
    eng = ScriptedEngine.from_text(tok, lambda p: "1 2 3 4 5 6 7 8 9")
    s = proxy.start_session(eng, sampling_overrides=True)
    out = await client(s).chat.completions.create(
        model="m", messages=MSGS, max_tokens=3, temperature=0.0, top_p=0.5, stop=["x"]
    )
    g = eng.requests[0].gconfig
    assert (g.max_new_tokens, g.temperature, g.greedy, g.top_p, g.stop) == (3, 0.0, True, 0.5, ["x"])
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.content == "1 2 3"
    locked = proxy.start_session(eng)  # the default (a Trinity workflow's openai client too): the policy's own
    await client(locked).chat.completions.create(model="m", messages=MSGS, temperature=0.0, max_tokens=2)
    assert eng.requests[-1].gconfig.temperature == 1.0 and eng.requests[-1].gconfig.max_new_tokens == 2


async def test_n_choices_completions_endpoint_and_models(proxy, tok):
    eng = ScriptedEngine.from_text(tok, lambda p: "5")
    s = proxy.start_session(eng)
    c = client(s)
    out = await c.chat.completions.create(model="m", messages=MSGS, n=3)
    assert len(out.choices) == 3 and [i.id for i in s.log] == [f"{out.id}:{k}" for k in range(3)]
    s.log.set_reward(out.id, 0.5)
    assert [i.reward for i in s.log] == [0.5] * 3
    comp = await c.completions.create(model="m", prompt="user : copy 5 .", logprobs=1)
    assert comp.choices[0].text == "5" and comp.choices[0].logprobs.token_logprobs[0] == scripted_logprob(
        eng.responses[-1].output_tokens[0], 0
    )
    assert s.log.last.prompt == "user : copy 5 ." and s.log.last.messages is None
    assert eng.responses[-1].input_tokens == tok("user : copy 5 .")["input_ids"]
    models = await c.models.list()
    assert [m.id for m in models.data] == [proxy.model_name]


async def test_api_key_selects_the_session_on_plain_paths(proxy, tok):
    s = proxy.start_session(ScriptedEngine.from_text(tok, lambda p: "4"))
    c = openai.AsyncOpenAI(
        base_url=f"{proxy.url}/v1", api_key=s.api_key, http_client=shared_http_client(), max_retries=0
    )
    out = await c.chat.completions.create(model="m", messages=MSGS)
    assert out.choices[0].message.content == "4" and len(s.log) == 1


async def test_errors_are_clear(proxy, tok):
    s = proxy.start_session(ScriptedEngine(lambda ids, call: 1 / 0))
    c = client(s)
    with pytest.raises(openai.APIStatusError, match="engine request failed.*ZeroDivisionError") as e:
        await c.chat.completions.create(model="m", messages=MSGS)
    assert e.value.status_code == 502
    with pytest.raises(openai.BadRequestError, match="streaming is not supported"):
        await c.chat.completions.create(model="m", messages=MSGS, stream=True)
    with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
        await c.chat.completions.create(model="m", messages=[])
    ended = proxy.start_session(ScriptedEngine())
    proxy.end_session(ended.id)
    with pytest.raises(openai.NotFoundError, match="unknown or closed session"):
        await client(ended).chat.completions.create(model="m", messages=MSGS)


async def test_set_reward_endpoint(proxy, tok):
    s = proxy.start_session(ScriptedEngine.from_text(tok, lambda p: "1"))
    out = await client(s).chat.completions.create(model="m", messages=MSGS)
    http = shared_http_client()
    r = await http.post(f"{s.base_url[:-3]}/rl/set_reward", json={"interaction_id": out.id, "reward": 2.5})
    assert r.status_code == 200 and s.log.get(out.id).reward == 2.5
    bad = await http.post(f"{s.base_url[:-3]}/rl/set_reward", json={"interaction_id": "nope", "reward": 1})
    assert bad.status_code == 400 and "no completion with id" in bad.json()["error"]["message"]


async def test_shared_http_client_is_one_per_loop():
    a, b = shared_http_client(), shared_http_client()
    assert a is b and isinstance(a, httpx2.AsyncClient)


async def test_agent_requests_go_through_aiohttp_not_httpcores_pool(proxy, tok, monkeypatch):
    """The shared client's requests travel on aiohttp's connection pool: httpcore's (a plain
    httpx.AsyncClient's transport) rescans all its connections, polling each socket, on every queued
    request and closed response, which cost most of the launcher's CPU with hundreds of episodes in
    flight (proxy.py; tools/bench_agent_http.py). Counted at both pools' entry points, so a client
    built on httpx's default transport again fails here."""
    seen = {"aiohttp": 0, "httpcore": 0}
    count_calls(monkeypatch, aiohttp.ClientSession, "_request", seen, "aiohttp")
    count_calls(monkeypatch, httpcore.AsyncConnectionPool, "handle_async_request", seen, "httpcore")
    sessions = [proxy.start_session(ScriptedEngine.from_text(tok, last_user_word, delay_s=0.01)) for _ in range(8)]
    await asyncio.gather(*(client(s).chat.completions.create(model="m", messages=MSGS) for s in sessions))
    assert all(len(s.log) == 1 for s in sessions)
    assert seen == {"aiohttp": 8, "httpcore": 0}


def _inter(cid, inp, out, reward=None):
    return Interaction(
        id=cid,
        model_response=ModelResponse(
            input_tokens=inp, output_tokens=out, output_logprobs=[-0.1] * len(out), output_versions=[1] * len(out)
        ),
        reward=reward,
    )


def test_reward_discount_and_export_styles():
    log = InteractionLog()
    log.add(_inter("a", [1, 2], [3, 4]))
    log.add(_inter("b", [1, 2, 3, 4, 9], [5]))          # extends a token for token
    log.add(_inter("c", [1, 2, 3, 4, 9, 5, 9], [6], reward=1.0))
    log.apply_reward_discount(0.5)
    assert [i.reward for i in log] == [0.25, 0.5, 1.0]
    with pytest.raises(RuntimeError, match="only once"):
        log.apply_reward_discount(0.5)
    ind = log.export_samples("individual")
    assert [s.reward for s in ind] == [0.25, 0.5, 1.0] and ind[1].tokens == [1, 2, 3, 4, 9, 5]
    (cat,) = log.export_samples("concat")
    assert cat.tokens == [1, 2, 3, 4, 9, 5, 9, 6] and cat.loss_mask == [0, 0, 1, 1, 0, 1, 0, 1]
    assert cat.versions == [-1, -1, 1, 1, -1, 1, -1, 1] and cat.reward == 1.0 and cat.prompt_len == 2
    # a completion whose input does not extend the earlier one stays separate
    log2 = InteractionLog()
    log2.add(_inter("a", [1, 2], [3]))
    log2.add(_inter("b", [7, 8], [9], reward=1.0))
    assert len(log2.export_samples("concat")) == 2


def test_concat_says_when_a_reward_on_an_extended_completion_is_not_trained(caplog):
    """concat trains a merged sample with its leaf's reward (AReaL's semantics): a reward the agent set
    on an earlier completion that a later one extends was dropped without a word."""
    from mlrl.types import ModelResponse
    from mlrl.workflow.agent_proxy.interactions import Interaction, InteractionLog

    def completion(cid, inp, out):
        return Interaction(id=cid, model_response=ModelResponse(
            input_tokens=inp, output_tokens=out, output_logprobs=[-0.1] * len(out), output_versions=[0] * len(out)))

    for reward_on, warned in (("A", True), ("B", False)):
        log = InteractionLog()
        log.add(completion("A", [1, 2], [3, 4]))
        log.add(completion("B", [1, 2, 3, 4, 5], [6, 7]))  # extends A token for token
        log.set_reward(reward_on, 1.0)
        log.apply_reward_discount(1.0)
        caplog.clear()
        (merged,) = log.export_samples("concat")
        assert merged.metadata["interaction_id"] == "B" and merged.reward == (0.0 if reward_on == "A" else 1.0)
        assert ("reward(s) set on 1 completion(s) that a later one extends (A)" in caplog.text) == warned


async def test_the_runs_stop_settings_stay_beside_a_requests_own_stop(proxy, tok):
    """rollout.sampling.stop / stop_token_ids reach an agent's requests through the session's
    gconfig; an agent's own `stop` adds to the run's stop strings instead of replacing them."""
    eng = ScriptedEngine.from_text(tok, lambda p: "1 2 3")
    run = GenerationHyperparameters(max_new_tokens=8, stop=["</answer>"], stop_token_ids=[5])
    s = proxy.start_session(eng, run)
    await client(s).chat.completions.create(model="m", messages=MSGS, stop=["x", "</answer>"])
    await client(s).chat.completions.create(model="m", messages=MSGS)
    (a, b) = [r.gconfig for r in eng.requests]
    assert (a.stop, a.stop_token_ids) == (["</answer>", "x"], [5])
    assert (b.stop, b.stop_token_ids) == (["</answer>"], [5])

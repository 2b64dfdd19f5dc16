"""Trinity-RFT compatibility: Task / Workflow / Experience / model wrapper semantics through the runner."""

import threading

import pytest
from _wf_helpers import count_calls, last_user_word
from helpers.scripted_engine import ScriptedEngine

from mlrl.types import GenerationHyperparameters
from mlrl.workflow import EpisodeRunner, EpisodeStatus, build_workflow
from mlrl.workflow.compat.trinity import WORKFLOWS, Experience, Task, TrinityWorkflowAdapter, Workflow

G = GenerationHyperparameters(max_new_tokens=6)
ROWS = [{"question": "copy 7", "answer": "7"}, {"question": "copy 3", "answer": "3"}]
BUILT = {"n": 0}


class Answer(Workflow):
    """Asks the question; reward 1 if the text equals the answer."""

    def __init__(self, *, task, model, auxiliary_models=None):
        super().__init__(task=task, model=model, auxiliary_models=auxiliary_models)
        BUILT["n"] += 1
        self.reset(task)

    def reset(self, task):
        self.question, self.answer = task.raw_task["question"], task.raw_task["answer"]
        self.temperature = task.rollout_args.temperature

    def run(self):
        (r,) = self.model.chat([{"role": "user", "content": self.question}], n=1, temperature=self.temperature)
        return [Experience(tokens=r.tokens, prompt_length=r.prompt_length, logprobs=r.logprobs,
                           reward=float(r.response_text == self.answer))]


class Resettable(Answer):
    can_reset = True


@WORKFLOWS.register_module("unit_repeatable")
class Repeatable(Answer):
    can_repeat = True

    def set_repeat_times(self, repeat_times, run_id_base):
        self.repeat_times, self.run_id_base = repeat_times, run_id_base

    def run(self):
        out = []
        for i, r in enumerate(self.model.chat([{"role": "user", "content": self.question}], n=self.repeat_times)):
            e = Experience(tokens=r.tokens, prompt_length=r.prompt_length, logprobs=r.logprobs, reward=float(i))
            e.eid.run = i + self.run_id_base
            out.append(e)
        return out


class ThroughOpenAI(Answer):
    """Synchronous OpenAI client inside run(); experiences from the recorded history."""

    def run(self):
        client = self.model.get_openai_client()
        out = client.chat.completions.create(
            model=client.model_path, messages=[{"role": "user", "content": self.question}]
        )
        exps = self.model.extract_experience_from_history()
        for e in exps:
            e.reward = float(out.choices[0].message.content == self.answer)
        return exps


CLIENTS: list = []


class SyncThroughOpenAI(Answer):
    """The synchronous OpenAI client in run() (a worker thread)."""

    def run(self):
        client = self.model.get_openai_client()
        CLIENTS.append(client)
        out = client.chat.completions.create(model=client.model_path,
                                             messages=[{"role": "user", "content": self.question}])
        return [self.scored(out)]

    def scored(self, out):
        right = float(out.choices[0].message.content == self.answer)
        return Experience(tokens=[1, 2], prompt_length=1, logprobs=[-0.1], reward=right)


class AsyncThroughOpenAI(SyncThroughOpenAI):
    """The asynchronous one in run_async (the event loop)."""

    is_async = True

    async def run_async(self):
        client = self.model.get_openai_async_client()
        out = await client.chat.completions.create(model=client.model_path,
                                                   messages=[{"role": "user", "content": self.question}])
        return [self.scored(out)]


BARRIER = threading.Barrier(2, timeout=10)


class NeedsAPartner(Answer):
    """Two episodes must be inside run() at once: only possible if run() does not block the loop."""

    def run(self):
        BARRIER.wait()
        return super().run()


class AsyncAnswer(Answer):
    is_async = True

    async def run_async(self):
        (r,) = await self.model.chat_async([{"role": "user", "content": self.question}])
        return [Experience(tokens=r.tokens, prompt_length=r.prompt_length, logprobs=r.logprobs, reward=1.0)]


class AsyncButSync(Answer):
    is_async = True

    async def run_async(self):
        return self.run()  # the blocking call from inside the event loop


class MultiTurnConverted(Answer):
    def run(self):
        msgs = [{"role": "user", "content": "copy 7"}, {"role": "assistant", "content": "7"},
                {"role": "user", "content": "copy 3"}, {"role": "assistant", "content": "3"}]
        e = self.model.convert_messages_to_experience(msgs)
        e.reward = 1.0
        return [e]


async def run(tok, cls, n=2, engine=None, concurrency=4, **kw):
    wf = build_workflow(cls, kwargs={"format_args": {"prompt_key": "question", "response_key": "answer"}, **kw},
                        tokenizer=tok, gconfig=G)
    runner = EpisodeRunner(wf, engine or ScriptedEngine.from_text(tok, last_user_word, version=7),
                           max_concurrency=concurrency, episode_timeout_s=30)
    try:
        groups = await runner.run_batch(ROWS, n=n)
    finally:
        await runner.aclose()
    return groups, runner.last_metrics


async def test_task_experience_and_conversion(tok):
    groups, m = await run(tok, Answer)
    assert isinstance(build_workflow(Answer, tokenizer=tok), TrinityWorkflowAdapter)
    assert [g.rewards for g in groups] == [[1.0, 1.0], [1.0, 1.0]]
    s = groups[0].samples[0]
    assert tok.decode(s.tokens) == "user : copy 7 . assistant : 7 </s>"
    assert s.loss_mask == [0] * 7 + [1, 1] and s.prompt_len == 7
    assert s.versions[-2:] == [7, 7] and "approx_versions" not in s.metadata  # recovered by token match
    assert m["reward/accuracy"] == 1.0
    t = Task(workflow=Answer, raw_task={"prompt": "p", "response": "r"})
    assert (t.task_desc, t.truth, t.to_dict()) == ("p", "r", {"prompt": "p", "response": "r"})


async def test_resettable_instances_are_reused(tok):
    BUILT["n"] = 0
    await run(tok, Answer, n=2, concurrency=1)
    assert BUILT["n"] == 4  # not resettable: a new instance per episode, as Trinity does
    BUILT["n"] = 0
    await run(tok, Resettable, n=2, concurrency=1)
    assert BUILT["n"] == 1


async def test_repeatable_workflow_produces_the_group_in_one_run(tok):
    BUILT["n"] = 0
    groups, m = await run(tok, Repeatable, n=3)
    assert BUILT["n"] == 2  # one run (one instance) per prompt
    assert [len(g.episodes) for g in groups] == [3, 3] and groups[0].rewards == [0.0, 1.0, 2.0]
    assert WORKFLOWS.get("unit_repeatable") is Repeatable


async def test_openai_client_and_history_inside_a_sync_run(tok):
    groups, _ = await run(tok, ThroughOpenAI, n=1, enable_history=True)
    s = groups[1].samples[0]
    assert s.reward == 1.0 and tok.decode(s.tokens) == "user : copy 3 . assistant : 3 </s>" and s.versions[-1] == 7


async def test_sync_run_does_not_block_the_event_loop(tok):
    groups, _ = await run(tok, NeedsAPartner, n=1, concurrency=2)
    assert all(g.count(EpisodeStatus.COMPLETED) == 1 for g in groups)


async def test_async_workflows_and_the_blocking_call_guard(tok):
    groups, _ = await run(tok, AsyncAnswer, n=1)
    assert [g.rewards for g in groups] == [[1.0], [1.0]]
    bad, _ = await run(tok, AsyncButSync, n=1)
    err = bad[0].episodes[0].info["error"]
    assert bad[0].episodes[0].status == EpisodeStatus.ERROR and "chat_async" in err["error_message"]


async def test_multi_turn_experience_masks_assistant_turns(tok):
    groups, _ = await run(tok, MultiTurnConverted, n=1)
    s = groups[0].samples[0]
    trained = tok.decode([t for t, m in zip(s.tokens, s.loss_mask) if m])
    assert trained == "7 . 3 ." and s.reward == 1.0
    # the template's tokens, not an engine's: no logprobs, flagged (0.0 looked like real ones, and a
    # run weighing against them, rollout_is / use_rollout_logprobs, took them silently)
    assert s.metadata.get("missing_logprobs") is True
    from mlrl.config import load_config
    from mlrl.update import check_rollout_logprobs

    with pytest.raises(ValueError, match=r"returned 1 of 1 sample\(s\) without logprobs"):
        check_rollout_logprobs(load_config(None, ["algorithm.rollout_is=tis"]), [s])


def test_experience_validation():
    with pytest.raises(ValueError, match="longer than prompt_length"):
        Experience(tokens=[1, 2], prompt_length=2)
    e = Experience(tokens=[1, 2, 3], prompt_length=2, logprobs=[-0.5])
    assert e.tokens.tolist() == [1, 2, 3] and e.experience_type == "single_turn"


class _ThroughOpenAI(Workflow):
    """Not resettable: built for one task (Trinity's default); calls the policy through the proxy."""

    def __init__(self, *, task, model, auxiliary_models=None):
        super().__init__(task=task, model=model, auxiliary_models=auxiliary_models)
        self.q = task.raw_task["question"]

    def run(self):
        c = self.model.get_openai_client()
        c.chat.completions.create(model=c.model_path, messages=[{"role": "user", "content": self.q}])
        exps = self.model.extract_experience_from_history()
        for e in exps:
            e.reward = 1.0
        return exps


class _FailsAfterACall(_ThroughOpenAI):
    def run(self):
        super().run()
        raise RuntimeError("the environment broke")


@pytest.mark.parametrize("cls,status", [(_ThroughOpenAI, EpisodeStatus.COMPLETED),
                                        (_FailsAfterACall, EpisodeStatus.ERROR)])
async def test_an_episodes_proxy_session_ends_with_it(tok, cls, status):
    """One session per episode stayed open for the whole run, holding every response it saw (a
    failed episode's too)."""
    wf = build_workflow(cls, kwargs={"enable_history": True}, tokenizer=tok, gconfig=G)
    runner = EpisodeRunner(wf, ScriptedEngine.from_text(tok, last_user_word), max_concurrency=4)
    try:
        for _ in range(2):
            groups = await runner.run_batch(ROWS, n=2)
            assert all(e.status == status for g in groups for e in g.episodes)
            assert wf.proxy._sessions == {}
    finally:
        await runner.aclose()


async def test_a_timed_out_async_workflow_stops_calling_the_engine(tok):
    import asyncio

    calls = []

    class Looping(Workflow):
        is_async = True

        async def run_async(self):
            for _ in range(8):  # an agent loop that outlives the episode's timeout
                (out,) = await self.model.chat_async([{"role": "user", "content": "copy 7"}])
                calls.append(out)
            return [out]

    wf = build_workflow(Looping, tokenizer=tok, gconfig=G)
    eng = ScriptedEngine.from_text(tok, last_user_word, delay_s=0.1)
    runner = EpisodeRunner(wf, eng, episode_timeout_s=0.25)
    try:
        g = await runner.run_group(ROWS[0], 1)
        assert g.episodes[0].status == EpisodeStatus.TIMEOUT
        at_timeout = len(eng.requests)
        await asyncio.sleep(0.6)
        assert len(eng.requests) <= at_timeout + 1 and len(calls) < 8  # it kept calling (8 calls, all loops)
    finally:
        await runner.aclose()


async def test_openai_clients_share_the_ssl_context_and_the_async_pool(tok, monkeypatch):
    """Each episode's OpenAI client used to build its own SSL context (the CA bundle read again:
    ~50 ms of CPU per episode) and, for the async one, its own httpx pool, never closed. Now: one
    SSL context per process, the async client on the process's shared aiohttp client, the sync
    client (an episode's own pool) closed when the episode ends."""
    import ssl

    import aiohttp

    from mlrl.workflow.agent_proxy.proxy import _ssl_context

    seen = {"ca_loads": 0, "aiohttp": 0}
    count_calls(monkeypatch, ssl.SSLContext, "load_verify_locations", seen, "ca_loads")
    count_calls(monkeypatch, aiohttp.ClientSession, "_request", seen, "aiohttp")
    _ssl_context.cache_clear()
    CLIENTS.clear()
    sync_groups, _ = await run(tok, SyncThroughOpenAI, n=2)
    async_groups, _ = await run(tok, AsyncThroughOpenAI, n=2)
    assert [g.rewards for g in sync_groups + async_groups] == [[1.0, 1.0]] * 4
    assert seen == {"ca_loads": 1, "aiohttp": 4}  # 8 clients, 1 context; the 4 async calls on aiohttp
    assert len(CLIENTS) == 4 and all(c.is_closed() for c in CLIENTS)

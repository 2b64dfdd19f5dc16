"""Trinity-RFT's workflow API on mlrl: `Task`, `Workflow`, `Experience`, `WORKFLOWS`, and the
`model` wrapper (`chat`, `generate`, `get_openai_client`, ...), so a Trinity workflow runs after
changing `from trinity.common.workflows import ...` to `from mlrl.workflow.compat.trinity import ...`.

How it runs: `TrinityWorkflowAdapter` is the RolloutWorkflow the episode runner sees. Per episode it
takes an idle workflow instance (reset with the new Task when `resettable()`, else built anew,
as Trinity's WorkflowRunner does) and calls the synchronous `run()` in a worker thread (`run_async()`
in the event loop when `is_async`), so the loop that serves every other episode never blocks.
`model.chat` in that thread schedules `engine.agenerate` on the loop and waits for it.
Repeatable workflows (`can_repeat`) get `set_repeat_times(n)` and produce the whole group in one
run; the others run n times, concurrently, one instance each. A thread cannot be cancelled: when an
episode times out, its `run()` keeps its worker thread until it returns, and every model call it
makes after the timeout raises (its proxy session is ended: OpenAI-client calls get a 404); a
`run_async()` coroutine is cancelled.

Conversion to samples: Experience.tokens = prompt + response, `prompt_length`, `logprobs` and
`action_mask` over the response part. Weight versions are not part of Trinity's Experience: they are
recovered from what this episode's model wrapper generated (exact token match), else set to the
oldest version the episode saw (flagged `approx_versions`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlrl.types import GenerationHyperparameters, Sample, SampleStatus, StopReason
from mlrl.workflow.api import (
    EpisodeOutput,
    EpisodeStatus,
    ModelRequest,
    RolloutWorkflow,
    apply_chat_template,
    is_evaluation,
)


# --- registry ------------------------------------------------------------------------------------
class Registry:
    """Trinity's `Registry`: `@WORKFLOWS.register_module("name")`, `WORKFLOWS.get("name")`."""

    def __init__(self, name: str):
        self.name = name
        self._modules: dict[str, Any] = {}

    def register_module(self, module_name: str, module_cls: Any = None, force: bool = False):
        def deco(cls: Any) -> Any:
            if module_name in self._modules and self._modules[module_name] is not cls and not force:
                raise ValueError(f"{module_name!r} is already registered in {self.name}")
            self._modules[module_name] = cls
            return cls

        return deco(module_cls) if module_cls is not None else deco

    def get(self, module_name: str) -> Any:
        return self._modules.get(module_name)

    @property
    def modules(self) -> dict[str, Any]:
        return dict(self._modules)


WORKFLOWS = Registry("workflows")


# --- configs and task ----------------------------------------------------------------------------
@dataclass
class FormatConfig:
    """Trinity's `buffer...taskset.format`: which raw_task keys hold the prompt and the answer."""

    prompt_key: str = "prompt"
    response_key: str = "response"
    messages_key: str = "message"
    system_prompt: str | None = None
    reply_prefix: str | None = None


@dataclass
class GenerationConfig:
    """Trinity's rollout_args."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    logprobs: int = 0
    n: int = 1
    max_tokens: int | None = None


@dataclass
class Task(dict):
    """One raw dataset row plus how to run it (Trinity's `trinity.common.workflows.Task`)."""

    workflow: Any = None
    repeat_times: int | None = None
    format_args: FormatConfig = field(default_factory=FormatConfig)
    rollout_args: GenerationConfig = field(default_factory=GenerationConfig)
    workflow_args: dict = field(default_factory=dict)
    reward_fn_args: dict = field(default_factory=dict)
    is_eval: bool = False
    reward_fn: Any = None
    raw_task: dict | None = None
    batch_id: int | str = ""
    task_id: int | str = ""
    index: dict = field(default_factory=dict)

    def to_workflow(self, model: Any, auxiliary_models: list | None = None) -> "Workflow":
        return self.workflow(model=model, task=self, auxiliary_models=auxiliary_models)

    @property
    def task_desc(self) -> str | None:
        return (self.raw_task or {}).get(self.format_args.prompt_key)

    @property
    def truth(self) -> str | None:
        return (self.raw_task or {}).get(self.format_args.response_key)

    def to_dict(self) -> dict:
        return self.raw_task or {}


# --- experience ----------------------------------------------------------------------------------
@dataclass
class EID:
    batch: int | str = 0
    task: int | str = 0
    run: int = 0
    step: int = 0
    suffix: str = field(default_factory=lambda: uuid.uuid4().hex[:6])

    @property
    def uid(self) -> str:
        return f"{self.batch}/{self.task}/{self.run}/{self.step}/{self.suffix}"


def _tensor(x: Any, dtype: str) -> Any:
    import torch

    if x is None or isinstance(x, torch.Tensor):
        return x
    return torch.tensor(list(x), dtype=getattr(torch, dtype))


class Experience:
    """Trinity's Experience: `tokens` [prompt + response], `prompt_length`, `logprobs` and
    `action_mask` over the response part, `reward`. Lists are stored as torch tensors, as in Trinity."""

    def __init__(
        self,
        *,
        eid: Any = None,
        tokens: Any,
        logprobs: Any = None,
        reward: float | None = None,
        advantages: Any = None,
        returns: Any = None,
        info: dict | None = None,
        metrics: dict | None = None,
        prompt_length: int = 1,
        response_text: str | None = None,
        prompt_text: str | None = None,
        action_mask: Any = None,
        messages: list | None = None,
        tools: list | None = None,
    ):
        self.tokens = _tensor(tokens, "int32")
        if action_mask is None:
            if prompt_length <= 0:
                raise ValueError("Experience: prompt_length must be > 0 for single-turn experiences")
            if len(self.tokens) <= prompt_length:
                raise ValueError(
                    f"Experience: tokens ({len(self.tokens)}) must be longer than prompt_length ({prompt_length})"
                )
            self.experience_type = "single_turn"
        else:
            self.experience_type = "multi_turn"
        self.action_mask = _tensor(action_mask, "bool")
        self.eid = EID(**eid) if isinstance(eid, dict) else (eid or EID())
        self.logprobs = _tensor(logprobs, "float32")
        self.reward = reward
        self.advantages = _tensor(advantages, "float32")
        self.returns = _tensor(returns, "float32")
        self.info = info or {}
        self.metrics = metrics or {}
        self.prompt_length = int(prompt_length)
        self.response_text = response_text
        self.prompt_text = prompt_text
        self.messages = messages
        self.tools = tools

    def __repr__(self) -> str:
        return f"Experience(len={len(self.tokens)}, prompt_length={self.prompt_length}, reward={self.reward})"


# --- workflow base -------------------------------------------------------------------------------
class Workflow:
    """Trinity's Workflow base: `__init__(*, task, model, auxiliary_models=None)`, `run()`."""

    can_reset: bool = False
    can_repeat: bool = False
    is_async: bool = False

    def __init__(self, *, task: Task, model: Any, auxiliary_models: list | None = None):
        self.task = task
        self.model = model
        self.auxiliary_models = auxiliary_models
        self.run_id_base = 0
        self.repeat_times = 1

    def resettable(self) -> bool:
        return type(self).can_reset

    @property
    def repeatable(self) -> bool:
        return type(self).can_repeat

    @property
    def asynchronous(self) -> bool:
        return type(self).is_async

    def reset(self, task: Task) -> None:
        raise NotImplementedError("reset() must be implemented by a resettable workflow")

    def set_repeat_times(self, repeat_times: int, run_id_base: int) -> None:
        raise NotImplementedError("set_repeat_times() must be implemented by a repeatable workflow")

    def run(self) -> list[Experience]:
        raise NotImplementedError

    async def run_async(self) -> list[Experience]:
        raise NotImplementedError


def _flag(obj: Any, name: str) -> bool:
    v = getattr(obj, name)
    return bool(v() if callable(v) else v)


# --- the model wrapper ---------------------------------------------------------------------------
class ModelWrapper:
    """What a Trinity workflow calls `self.model`: chat/generate on the policy, plus an OpenAI
    client through mlrl's recording proxy. One per workflow instance; re-bound to each episode."""

    def __init__(self, adapter: "TrinityWorkflowAdapter", enable_history: bool = False):
        self._adapter = adapter
        self.tokenizer = adapter.tokenizer
        self.enable_history = enable_history
        self.history: list[Experience] = []
        self._engine: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._generated: dict[tuple[int, ...], list[int]] = {}
        self._versions_seen: list[int] = []
        self._session: Any = None
        self.openai_client: Any = None
        self.openai_async_client: Any = None
        self.cancelled = False

    def _bind(self, engine: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._engine, self._loop, self.cancelled = engine, loop, False
        self._generated, self._versions_seen, self.history = {}, [], []
        if self._session is not None:
            self._session.engine = engine
            self._session.log = type(self._session.log)()

    def _sync(self, coro: Any) -> Any:
        if self.cancelled:
            coro.close()
            raise RuntimeError("the episode was cancelled (timeout); no more model calls")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            coro.close()
            raise RuntimeError("synchronous model.chat/generate called from the event loop: async workflows "
                               "(is_async=True) must use chat_async / generate_async / get_openai_async_client")
        assert self._loop is not None, "ModelWrapper used before _bind"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _gconfig(self, kw: dict[str, Any]) -> tuple[GenerationHyperparameters, int]:
        kw = dict(kw)
        n = int(kw.pop("n", 1))
        mapping = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_tokens": "max_new_tokens",
                   "max_new_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "stop": "stop"}
        over = {mapping[k]: v for k, v in kw.items() if k in mapping and v is not None}
        if "stop" in over:  # the call's stop strings, besides the run's (rollout.sampling.stop)
            over["stop"] = self._adapter.gconfig.plus_stop(over["stop"])
        if "temperature" in over:
            over["greedy"] = float(over["temperature"]) == 0.0
        return self._adapter.gconfig.new(n_samples=1, **over), n

    async def _agenerate_ids(self, input_ids: list[int], **kw: Any) -> list[Experience]:
        if self.cancelled:  # the async paths (run_async, chat_async) too, not only the blocking calls
            raise RuntimeError("the episode was cancelled (timeout); no more model calls")
        gconfig, n = self._gconfig(kw)
        reqs = [ModelRequest(input_ids=list(input_ids), gconfig=gconfig, tokenizer=self.tokenizer) for _ in range(n)]
        resps = await asyncio.gather(*(self._engine.agenerate(r) for r in reqs))
        exps = []
        for r in resps:
            if r.stop_reason.unfinished:
                raise RuntimeError(f"engine request failed ({r.stop_reason.value}): {r.error}")
            tokens = list(r.input_tokens) + list(r.output_tokens)
            self._generated[tuple(tokens)] = list(r.output_versions)
            self._versions_seen.extend(r.output_versions)
            if not r.output_tokens:  # Trinity's Experience needs at least one response token
                raise RuntimeError("the engine returned an empty response")
            exps.append(Experience(
                tokens=tokens, prompt_length=r.input_len, logprobs=list(r.output_logprobs),
                response_text=self.tokenizer.decode(r.output_tokens, skip_special_tokens=True),
                prompt_text=self.tokenizer.decode(r.input_tokens),
                info={"versions": list(r.output_versions), "truncated": r.stop_reason == StopReason.LENGTH},
            ))
        if self.enable_history:
            self.history.extend(exps)
        return exps

    async def chat_async(self, messages: list[dict], **kwargs: Any) -> list[Experience]:
        return await self._agenerate_ids(
            apply_chat_template(self.tokenizer, messages, add_generation_prompt=True), **kwargs
        )

    def chat(self, messages: list[dict], **kwargs: Any) -> list[Experience]:
        """Responses to a conversation: `n` of them, each an Experience with response_text, tokens,
        prompt_length, logprobs (blocks the calling thread, never the event loop)."""
        return self._sync(self.chat_async(messages, **kwargs))

    async def generate_async(self, prompts: list[str], **kwargs: Any) -> list[Experience]:
        outs = await asyncio.gather(*(self._agenerate_ids(self.tokenizer(p)["input_ids"], **kwargs) for p in prompts))
        return [e for group in outs for e in group]

    def generate(self, prompts: list[str], **kwargs: Any) -> list[Experience]:
        return self._sync(self.generate_async(prompts, **kwargs))

    def convert_messages_to_experience(self, messages: list[dict]) -> Experience:
        """A conversation as one Experience whose action mask covers the assistant turns. Its
        tokens are the template's, not an engine's: no logprobs (None, so that a run that would
        weigh against them refuses it, mlrl.update.check_rollout_logprobs)."""
        from mlrl.data.chat_tokens import tokenize_messages

        ids, mask = tokenize_messages(self.tokenizer, messages)
        p = next((i for i, m in enumerate(mask) if m), len(mask))
        return Experience(tokens=ids, prompt_length=p, action_mask=mask[p:], logprobs=None, messages=messages)

    @property
    def model_version(self) -> int:
        return max(self._versions_seen) if self._versions_seen else int(getattr(self._engine, "version", 0) or 0)

    def _open_session(self) -> Any:
        if self._session is None:
            self._session = self._adapter.proxy.start_session(self._engine, self._adapter.gconfig)
        return self._session

    def get_openai_client(self) -> Any:
        """A synchronous `openai.OpenAI` client whose calls go to the policy through the recording proxy."""
        import openai

        from mlrl.workflow.agent_proxy.proxy import shared_ssl_context

        if self.openai_client is None:
            s = self._open_session()
            # the episode's own connection pool (httpcore's sync pool has known races when threads
            # share one), but the process's SSL context: building one per client read the CA
            # bundle again, ~50 ms of CPU per episode
            http = openai.DefaultHttpxClient(verify=shared_ssl_context())
            self.openai_client = openai.OpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0, http_client=http)
            self.openai_client.model_path = self._adapter.proxy.model_name
        return self.openai_client

    def get_openai_async_client(self) -> Any:
        import openai

        from mlrl.workflow.agent_proxy.proxy import shared_http_client, shared_ssl_context

        if self.openai_async_client is None:
            s = self._open_session()
            try:
                in_loop = asyncio.get_running_loop() is self._loop
            except RuntimeError:
                in_loop = False
            # in the episode's loop: the process's shared client (proxy.shared_http_client: one
            # aiohttp pool); elsewhere a client of its own, on the process's SSL context
            http = shared_http_client() if in_loop else openai.DefaultAsyncHttpxClient(verify=shared_ssl_context())
            self.openai_async_client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0,
                                                          http_client=http)
            self.openai_async_client.model_path = self._adapter.proxy.model_name
        return self.openai_async_client

    def extract_experience_from_history(self, clear_history: bool = True) -> list[Experience]:
        """Experiences of every chat/generate call and every OpenAI-client completion of this episode."""
        if not self.enable_history:
            raise ValueError("history recording is not enabled (workflow kwarg enable_history=True)")
        exps = list(self.history)
        if self._session is not None:
            for inter in self._session.log:
                r = inter.model_response
                exps.append(Experience(tokens=list(r.input_tokens) + list(r.output_tokens), prompt_length=r.input_len,
                                       logprobs=list(r.output_logprobs), response_text=inter.text,
                                       info={"versions": list(r.output_versions)}))
        if clear_history:
            self.history = []
        return exps

    def _end_session(self) -> None:
        """The episode's proxy session ends with it (an instance that is not reused): it held every
        response of the episode, and a late call from a timed-out run gets a 404, not the policy."""
        if self._session is not None:
            try:
                self._adapter.proxy.end_session(self._session.id)
            except KeyError:  # the proxy was stopped (aclose) and its sessions with it
                pass
            self._session = None
            if self.openai_client is not None:
                self.openai_client.close()  # the episode's own pool (the async client's is the shared one)
            self.openai_client = self.openai_async_client = None

    def _record_proxy(self) -> None:
        if self._session is not None:
            for inter in self._session.log:
                r = inter.model_response
                self._generated[tuple(list(r.input_tokens) + list(r.output_tokens))] = list(r.output_versions)
                self._versions_seen.extend(r.output_versions)


# --- the adapter -------------------------------------------------------------------------------------
class TrinityWorkflowAdapter(RolloutWorkflow):
    """Runs a Trinity `Workflow` subclass as an mlrl RolloutWorkflow (see the module docstring)."""

    def __init__(
        self,
        workflow_cls: type[Workflow],
        *,
        tokenizer: Any,
        gconfig: GenerationHyperparameters | None = None,
        reward_fn: Any = None,
        format_args: dict | FormatConfig | None = None,
        rollout_args: dict | GenerationConfig | None = None,
        workflow_args: dict | None = None,
        reward_fn_args: dict | None = None,
        auxiliary_models: list | None = None,
        enable_history: bool = False,
        max_threads: int = 64,
    ):
        if not (inspect.isclass(workflow_cls) and issubclass(workflow_cls, Workflow)):
            raise TypeError(f"TrinityWorkflowAdapter needs a compat.trinity.Workflow subclass, got {workflow_cls!r}")
        if tokenizer is None:
            raise ValueError("a Trinity workflow needs the model's tokenizer")
        from mlrl.workflow.agent_proxy.proxy import OpenAIProxy

        self.workflow_cls = workflow_cls
        self.tokenizer = tokenizer
        self.gconfig = (gconfig or GenerationHyperparameters()).new(n_samples=1)
        self.reward_fn = reward_fn
        self.format_args = format_args if isinstance(format_args, FormatConfig) else FormatConfig(**(format_args or {}))
        base_rollout = {
            "temperature": self.gconfig.temperature,
            "top_p": self.gconfig.top_p,
            "top_k": self.gconfig.top_k,
            "max_tokens": self.gconfig.max_new_tokens,
        }
        if isinstance(rollout_args, GenerationConfig):
            self.rollout_args = rollout_args
        else:
            self.rollout_args = GenerationConfig(**{**base_rollout, **(rollout_args or {})})
        self.workflow_args = dict(workflow_args or {})
        self.reward_fn_args = dict(reward_fn_args or {})
        self.auxiliary_models = auxiliary_models
        self.enable_history = enable_history
        self.proxy = OpenAIProxy(tokenizer, default_gconfig=self.gconfig)
        self._max_threads = max_threads
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._idle: list[Workflow] = []
        self._lock = threading.Lock()
        self.group_native = _class_repeatable(workflow_cls)

    def _task(self, data: dict[str, Any], repeat_times: int) -> Task:
        rollout = copy.deepcopy(self.rollout_args)
        return Task(
            workflow=self.workflow_cls,
            repeat_times=repeat_times,
            format_args=copy.deepcopy(self.format_args),
            rollout_args=rollout,
            workflow_args=dict(self.workflow_args),
            reward_fn_args=dict(self.reward_fn_args),
            reward_fn=self.reward_fn,
            raw_task=data,
            is_eval=is_evaluation(),
        )

    def _acquire(self, task: Task) -> Workflow:
        """An instance for `task` (in the worker thread: __init__ may call the model synchronously)."""
        with self._lock:
            inst = self._idle.pop() if self._idle else None
        if inst is not None:
            inst.model._bind(self._current_engine(), self._loop)
            inst.reset(task)
            return inst
        model = ModelWrapper(self, enable_history=self.enable_history)
        model._bind(self._current_engine(), self._loop)
        return task.to_workflow(model, self.auxiliary_models)

    def _current_engine(self) -> Any:
        return _EPISODE_ENGINE.engine

    def _release(self, inst: Workflow) -> None:
        if _flag(inst, "resettable"):
            with self._lock:
                self._idle.append(inst)
        else:  # built for this episode only
            inst.model._end_session()

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> EpisodeOutput:
        return (await self._run(engine, data, 1, 0))[0]

    async def arun_group(self, engine: Any, data: dict[str, Any], n: int) -> list[EpisodeOutput]:
        """Repeatable workflows: one run producing n samples, split into n episodes by eid.run."""
        return await self._run(engine, data, n, 0)

    async def _run(self, engine: Any, data: dict[str, Any], repeat: int, run_id_base: int) -> list[EpisodeOutput]:
        if not self.proxy.started:
            await self.proxy.start()
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(
                max_workers=self._max_threads, thread_name_prefix="trinity-wf"
            )
        self._loop = asyncio.get_running_loop()
        task = self._task(data, repeat)
        holder: dict[str, Any] = {}

        def build_and_run() -> list[Experience]:
            _EPISODE_ENGINE.engine = engine
            inst = holder["inst"] = self._acquire(task)
            if repeat > 1 or _flag(inst, "repeatable"):
                inst.set_repeat_times(repeat, run_id_base)
            if _flag(inst, "asynchronous"):
                holder["future"] = asyncio.run_coroutine_threadsafe(inst.run_async(), self._loop)
                return holder["future"].result()
            return inst.run()

        try:
            exps = await self._loop.run_in_executor(self._threads, build_and_run)
        except asyncio.CancelledError:  # timed out: its model calls stop, its coroutine is cancelled
            if "inst" in holder:
                holder["inst"].model.cancelled = True
                holder["inst"].model._end_session()
            if "future" in holder:
                holder["future"].cancel()
            raise
        except BaseException:  # the run failed: its instance is not reused, its session ends
            if "inst" in holder:
                holder["inst"].model._end_session()
            raise
        inst = holder["inst"]
        inst.model._record_proxy()
        try:
            outs = self._to_outputs(exps, inst.model, repeat)
        finally:
            self._release(inst)
        return outs

    def _to_outputs(self, exps: Any, model: ModelWrapper, repeat: int) -> list[EpisodeOutput]:
        if not isinstance(exps, list) or not all(isinstance(e, Experience) for e in exps):
            raise TypeError(f"Trinity workflow run() must return a list of Experience, got {type(exps).__name__}")
        if not exps:
            return [EpisodeOutput(status=EpisodeStatus.REJECTED, info={"reason": "run() returned no experience"})]
        floor = min(model._versions_seen) if model._versions_seen else -1
        by_run: dict[int, list[Sample]] = {}
        metrics: dict[int, list[dict]] = {}
        for e in exps:
            s = experience_to_sample(e, model._generated, floor)
            run = int(e.eid.run) if repeat > 1 else 0
            by_run.setdefault(run, []).append(s)
            metrics.setdefault(run, []).append(e.metrics or {})
        outs = []
        for run in sorted(by_run):
            ms = metrics[run]
            keys = {k for m in ms for k, v in m.items() if isinstance(v, (int, float))}
            avg = {k: sum(float(m[k]) for m in ms if k in m) / sum(k in m for m in ms) for k in keys}
            outs.append(EpisodeOutput(samples=by_run[run], metrics=avg))
        return outs

    async def aclose(self) -> None:
        """Stop the proxy and the worker threads; the adapter starts them again if used afterwards."""
        await self.proxy.aclose()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
        with self._lock:
            for inst in self._idle:
                inst.model._end_session()
            self._idle.clear()  # their OpenAI clients point at the stopped proxy


class _EpisodeEngine(threading.local):
    engine: Any = None


_EPISODE_ENGINE = _EpisodeEngine()


def _class_repeatable(cls: type) -> bool:
    """Trinity decides per instance; an adapter must decide per class (can_repeat, or a constant override)."""
    if getattr(cls, "can_repeat", False):
        return True
    attr = inspect.getattr_static(cls, "repeatable", None)
    fn = attr.fget if isinstance(attr, property) else attr
    if fn is not None and fn is not Workflow.__dict__["repeatable"].fget:
        try:
            return bool(fn(None))
        except Exception:
            return False
    return False


def experience_to_sample(
    exp: Experience, generated: dict[tuple[int, ...], list[int]], version_floor: int = -1
) -> Sample:
    """Experience -> Sample (loss mask = action mask over the response; versions recovered by token match)."""
    tokens = [int(t) for t in exp.tokens.tolist()]
    p = int(exp.prompt_length)
    r = len(tokens) - p
    if r < 0:
        raise ValueError(f"Experience: prompt_length {p} exceeds its {len(tokens)} tokens")
    action = [int(bool(a)) for a in exp.action_mask.tolist()] if exp.action_mask is not None else [1] * r
    lps = [float(x) for x in exp.logprobs.tolist()] if exp.logprobs is not None else None
    meta: dict[str, Any] = {"eid": exp.eid.uid}
    if len(action) != r:
        raise ValueError(f"Experience: action_mask has {len(action)} entries for {r} response tokens")
    if lps is None:
        lps, meta["missing_logprobs"] = [0.0] * r, True
    if len(lps) != r:
        raise ValueError(f"Experience: logprobs has {len(lps)} entries for {r} response tokens")
    vers = exp.info.get("versions") if isinstance(exp.info, dict) else None
    if vers is None:
        vers = generated.get(tuple(tokens))
    if vers is None or len(vers) != r:
        vers, meta["approx_versions"] = [version_floor] * r, True
    reward = exp.reward
    if reward is None:
        reward, meta["missing_reward"] = 0.0, True
    truncated = bool(exp.info.get("truncated")) if isinstance(exp.info, dict) else False
    if exp.response_text is not None:
        meta["response_text"] = exp.response_text
    return Sample(
        tokens=tokens,
        loss_mask=[0] * p + action,
        rollout_logprobs=[0.0] * p + [lp if a else 0.0 for lp, a in zip(lps, action)],
        versions=[-1] * p + [int(v) if a else -1 for v, a in zip(vers, action)],
        reward=float(reward),
        prompt_len=p + next((i for i, a in enumerate(action) if a), r),
        status=SampleStatus.TRUNCATED if truncated else SampleStatus.COMPLETED,
        metadata=meta,
    )


__all__ = [
    "EID",
    "Experience",
    "FormatConfig",
    "GenerationConfig",
    "ModelWrapper",
    "Registry",
    "Task",
    "TrinityWorkflowAdapter",
    "WORKFLOWS",
    "Workflow",
    "experience_to_sample",
]

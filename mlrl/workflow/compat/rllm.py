"""rLLM's workflow API on mlrl: `Workflow`, `Episode`, `Trajectory`, `Step`, `Action`, `ModelOutput`,
`TerminationReason`, `TerminationEvent`, `BaseAgent`, `BaseEnv`, `RolloutEngine` (+ the
`MultiTurnWorkflow` / `SingleTurnWorkflow` of agent + environment), with rLLM's semantics:
- `run_with_termination_handling`: a timeout -> TIMEOUT, a `TerminationEvent` -> its reason, any
  other exception -> ERROR with {error_message, error_type, traceback} in `episode.info["error"]`;
  an Episode returned by `run` is taken as already post-processed;
- `postprocess_episode`: drop a trailing step without chat_completions, trajectory reward = sum
  of step rewards, then (for >1 step) shaping `r_i += reward_bonus_coeff * (r_i - r_{i-1})` on the
  raw rewards and, when gamma > 0, Monte-Carlo returns `G_t = r_t + gamma * G_{t+1}` replacing
  the step rewards; `is_correct` = total trajectory reward > 0; metrics `<trajectory name>_acc`.

`RLLMWorkflowAdapter` is what the episode runner sees: a pool of workflow instances (built once,
reused; each runs one episode at a time), `rollout_engine.get_model_response(messages)` served by
the mlrl engine through the model's chat template, and Episode -> Samples conversion:
- each sample's group is the prompt's group plus the trajectory name (rLLM groups trajectories
  by name, e.g. "solver" and "judge" get separate GRPO groups);
- `step_rewards="trajectory"`: a trajectory whose steps extend each other token for token becomes
  one sequence (loss mask on every response); other steps become one sample each; all carry the
  trajectory reward. `"step"`: one sample per step with its own (shaped / MC-return) reward.
  `"auto"` (default) picks "step" when gamma > 0 or reward_bonus_coeff > 0, else "trajectory";
- steps an agent recorded from text only get the token ids of the engine call they came from
  (matched by conversation, else by text; never re-tokenized); ERROR / TIMEOUT episodes are not
  trained on (recorded with their info); steps still without token ids are skipped and counted.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import time
import traceback
import uuid
from abc import ABC, abstractmethod
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from mlrl import types as _types
from mlrl.reward import import_from_string
from mlrl.types import (
    Episode,
    GenerationHyperparameters,
    Sample,
    SampleStatus,
    StopReason,
    TerminationReason,
    Trajectory,
)
from mlrl.workflow.api import EpisodeOutput, EpisodeStatus, ModelRequest, RolloutWorkflow, apply_chat_template


class TerminationEvent(Exception):
    def __init__(self, reason: TerminationReason = TerminationReason.UNKNOWN):
        super().__init__(f"Terminated: {reason}")
        self.reason = reason


@dataclass
class Action:
    action: Any = None


@dataclass
class ModelOutput:
    """What `RolloutEngine.get_model_response` returns (rLLM's fields + per-token `versions`)."""

    text: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list | None = None
    prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None
    logprobs: list[float] | None = None
    prompt_length: int = 0
    completion_length: int = 0
    finish_reason: str | None = None
    weight_version: int | None = None
    versions: list[int] | None = None


@dataclass
class Step(_types.Step):
    """rLLM's Step: token fields are back-filled from `model_output` when not given."""

    model_output: Any = None
    weight_version: int | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        self.chat_completions = copy.deepcopy(self.chat_completions)
        mo = self.model_output
        if mo is None:
            return
        if not self.prompt_ids and getattr(mo, "prompt_ids", None) is not None:
            self.prompt_ids = list(mo.prompt_ids)
        if not self.response_ids and getattr(mo, "completion_ids", None) is not None:
            self.response_ids = list(mo.completion_ids)
        if not self.logprobs and getattr(mo, "logprobs", None) is not None:
            self.logprobs = list(mo.logprobs)
        if not self.versions and getattr(mo, "versions", None) is not None:
            self.versions = list(mo.versions)
        if self.weight_version is None:
            self.weight_version = getattr(mo, "weight_version", None)
        if self.logprobs and len(self.logprobs) != len(self.response_ids):
            raise ValueError(f"Step: {len(self.response_ids)} response_ids but {len(self.logprobs)} logprobs")

    @classmethod
    def from_model_output(
        cls, model_output: ModelOutput, messages: list[dict] | None = None, action: Any = None
    ) -> "Step":
        return cls(
            chat_completions=(messages or [])
            + [{"role": "assistant", "content": model_output.content, "reasoning": model_output.reasoning}],
            thought=model_output.reasoning or "",
            action=action,
            model_response=model_output.content or "",
            model_output=model_output,
        )


class BaseAgent(ABC):
    """rLLM's agent: keeps the conversation, turns model text into actions, records steps."""

    @property
    def chat_completions(self) -> list[dict[str, str]]:
        return []

    @property
    def trajectory(self) -> Trajectory:
        return Trajectory()

    def update_from_env(self, observation: Any, reward: float, done: bool, info: dict, **kwargs: Any) -> None:
        raise NotImplementedError("Subclasses must implement update_from_env")

    def update_from_model(self, response: str, **kwargs: Any) -> Action:
        raise NotImplementedError("Subclasses must implement update_from_model")

    @abstractmethod
    def reset(self) -> None:
        return

    def get_current_state(self) -> _types.Step | None:
        return self.trajectory.steps[-1] if self.trajectory.steps else None


class BaseEnv(ABC):
    """rLLM's Gym-style environment."""

    @property
    def idx(self) -> Any:
        return getattr(self, "_idx", None)

    @idx.setter
    def idx(self, value: Any) -> None:
        self._idx = value

    @abstractmethod
    def reset(self) -> tuple[Any, dict]: ...

    @abstractmethod
    def step(self, action: Any) -> tuple[Any, float, bool, dict]: ...

    def close(self) -> None:
        return

    @staticmethod
    def from_dict(info: dict) -> "BaseEnv":
        raise NotImplementedError("Subclasses must implement the 'from_dict' static method.")

    @staticmethod
    def is_multithread_safe() -> bool:
        return True


class RolloutEngine:
    """rLLM's rollout engine interface: `await get_model_response(messages, **kwargs) -> ModelOutput`."""

    tokenizer: Any = None
    chat_parser: Any = None
    is_validation: bool = False

    def __init__(self, *args: Any, **kwargs: Any):
        self.weight_version = 0

    async def get_model_response(self, messages: list[dict], **kwargs: Any) -> ModelOutput:
        raise NotImplementedError

    async def wake_up(self) -> None:
        pass

    async def sleep(self) -> None:
        pass


_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_tokens": "max_new_tokens",
                  "max_new_tokens": "max_new_tokens", "stop": "stop"}


class MlrlRolloutEngine(RolloutEngine):
    """Serves `get_model_response` with an mlrl engine (`agenerate`) and the model's chat template."""

    def __init__(self, tokenizer: Any, gconfig: GenerationHyperparameters, engine: Any = None):
        super().__init__()
        self.tokenizer = tokenizer
        self.gconfig = gconfig
        self.engine = engine
        self.calls: list[tuple[list[dict], ModelOutput]] = []   # this episode's (messages, output), in order

    def bind(self, engine: Any) -> None:
        self.engine, self.calls = engine, []

    async def get_model_response(self, messages: list[dict], **kwargs: Any) -> ModelOutput:
        if self.engine is None:
            raise RuntimeError("MlrlRolloutEngine is not bound to an engine (it is bound per episode by the adapter)")
        over = {_SAMPLING_KEYS[k]: v for k, v in kwargs.items() if k in _SAMPLING_KEYS and v is not None}
        if "stop" in over:  # the call's stop strings, besides the run's (rollout.sampling.stop)
            over["stop"] = self.gconfig.plus_stop(over["stop"])
        if "temperature" in over:
            over["greedy"] = float(over["temperature"]) == 0.0
        tpl = dict(kwargs.get("chat_template_kwargs") or {})
        if kwargs.get("tools"):
            tpl["tools"] = kwargs["tools"]
        input_ids = apply_chat_template(self.tokenizer, messages, add_generation_prompt=True, **tpl)
        req = ModelRequest(input_ids=input_ids, gconfig=self.gconfig.new(n_samples=1, **over),
                           session_id=kwargs.get("application_id"), tokenizer=self.tokenizer)
        resp = await self.engine.agenerate(req)
        if resp.stop_reason.unfinished:
            raise RuntimeError(f"engine request failed ({resp.stop_reason.value}): {resp.error}")
        text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        reasoning, sep, content = text.partition("</think>")
        if not sep:
            reasoning, content = "", text
        versions = list(resp.output_versions)
        out = ModelOutput(
            text=text,
            content=content.strip() if sep else content,
            reasoning=reasoning.replace("<think>", "").strip(),
            prompt_ids=list(resp.input_tokens),
            completion_ids=list(resp.output_tokens),
            logprobs=list(resp.output_logprobs),
            prompt_length=resp.input_len,
            completion_length=resp.output_len,
            finish_reason="length" if resp.stop_reason == StopReason.LENGTH else "stop",
            weight_version=min(versions) if versions else None,
            versions=versions,
        )
        self.calls.append((copy.deepcopy(messages), out))
        return out


class Workflow(ABC):
    """rLLM's Workflow base class (see the module docstring for its semantics)."""

    def __init__(self, rollout_engine: RolloutEngine, executor: ThreadPoolExecutor, timeout: float = 1e6,
                 gamma: float = 0.0, reward_bonus_coeff: float = 0.0, **kwargs: Any):
        self.rollout_engine = rollout_engine
        self.executor = executor
        self.timeout = int(timeout)
        self.gamma = gamma
        self.reward_bonus_coeff = reward_bonus_coeff
        self._completed_trajectories: list[Trajectory] = []

    @abstractmethod
    async def run(self, task: dict, uid: str, **kwargs: Any) -> Episode | None:
        """Execute the workflow on one task."""

    async def run_with_termination_handling(self, task: dict, uid: str, **kwargs: Any) -> Episode:
        timeout = kwargs.pop("timeout", self.timeout)
        try:
            output = await asyncio.wait_for(self.run(task, uid, **kwargs), timeout=timeout)
            if isinstance(output, Episode):
                return output
            return self.postprocess_episode(self.collect_trajectories(), TerminationReason.UNKNOWN)
        except asyncio.TimeoutError:
            return self.postprocess_episode(self.collect_trajectories(), TerminationReason.TIMEOUT)
        except TerminationEvent as e:
            return self.postprocess_episode(self.collect_trajectories(), e.reason)
        except Exception as e:
            error = {"error_message": str(e), "error_type": type(e).__name__, "traceback": traceback.format_exc()}
            return self.postprocess_episode(self.collect_trajectories(), TerminationReason.ERROR, error=error)

    def _attrs(self, cls: type) -> list[Any]:
        out = []
        for name in dir(self):
            if name.startswith("_"):
                continue
            try:
                value = getattr(self, name)
            except Exception:
                continue
            if isinstance(value, cls):
                out.append(value)
        return out

    def commit(self, name: str | None = None, agent: BaseAgent | None = None, trajectory: Trajectory | None = None,
               reset: bool = False) -> None:
        """Keep a trajectory for training (an agent's current one, or the one given)."""
        if (agent is None) == (trajectory is None):
            raise ValueError("commit: give exactly one of agent or trajectory")
        traj = agent.trajectory if agent is not None else trajectory
        assert traj is not None
        if name:
            traj.name = name
        if traj.steps:
            self._completed_trajectories.append(copy.deepcopy(traj))
        if agent is not None and reset:
            agent.reset()

    def collect_trajectories(self) -> Episode:
        episode = Episode()
        episode.trajectories.extend(self._completed_trajectories)
        done = {t.uid for t in self._completed_trajectories}
        for agent in self._attrs(BaseAgent):
            traj = agent.trajectory
            if getattr(traj, "uid", None) not in done and traj.steps:
                episode.trajectories.append(copy.deepcopy(traj))
        return episode

    def compute_trajectory_reward(self, trajectory: Trajectory) -> None:
        trajectory.reward = float(sum(s.reward for s in trajectory.steps))

    def adjust_step_rewards(self, trajectory: Trajectory) -> None:
        if self.reward_bonus_coeff > 0.0:
            raw = [s.reward for s in trajectory.steps]
            for i in range(1, len(trajectory.steps)):
                trajectory.steps[i].reward += self.reward_bonus_coeff * (raw[i] - raw[i - 1])
        if self.gamma > 0.0:
            g = 0.0
            for step in reversed(trajectory.steps):
                g = step.reward + self.gamma * g
                step.reward = g
                step.mc_return = g

    def assign_episode_correctness(self, episode: Episode) -> None:
        episode.is_correct = sum((t.reward or 0) for t in episode.trajectories) > 0

    def collect_metrics(self, episode: Episode) -> None:
        by_name: dict[str, list[float]] = defaultdict(list)
        for t in episode.trajectories:
            by_name[t.name].append(t.reward or 0.0)
        episode.metrics = {f"{k}_acc": float(sum(v) / len(v)) for k, v in by_name.items()}

    def postprocess_episode(self, episode: Episode, termination_reason: TerminationReason | None = None,
                            error: dict | None = None) -> Episode:
        episode.id = getattr(self, "uid", episode.id)
        episode.task = getattr(self, "task", episode.task)
        for traj in episode.trajectories:
            if traj.steps and not traj.steps[-1].chat_completions:
                traj.steps.pop()
            self.compute_trajectory_reward(traj)
            if len(traj.steps) > 1:
                self.adjust_step_rewards(traj)
        self.assign_episode_correctness(episode)
        self.collect_metrics(episode)
        if error is not None:
            episode.info["error"] = error
        episode.termination_reason = termination_reason or TerminationReason.UNKNOWN
        return episode

    def reset(self, task: dict | None = None, uid: str | None = None) -> None:
        self.uid = uid
        self.task = task
        self._completed_trajectories = []
        for agent in self._attrs(BaseAgent):
            agent.reset()
            agent.trajectory.task = task
        for env in self._attrs(BaseEnv):
            env.reset(task=task)

    def is_multithread_safe(self) -> bool:
        return all(env.is_multithread_safe() for env in self._attrs(BaseEnv))

    async def run_in_executor(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, partial(fn, *args, **kwargs))


if TYPE_CHECKING:
    _MixinBase = Workflow  # what the mixin is mixed into, so its attributes and super() calls type-check
else:
    _MixinBase = object


class TimingTrackingMixin(_MixinBase):
    """rLLM's timing mixin, reduced: `timed_llm_call` / `timed_env_call` and totals in episode.info["timing"]."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._timing = {"llm_time": 0.0, "env_time": 0.0}

    async def timed_llm_call(self, *args: Any, **kwargs: Any) -> ModelOutput:
        t = time.monotonic()
        try:
            return await self.rollout_engine.get_model_response(*args, **kwargs)
        finally:
            self._timing["llm_time"] += time.monotonic() - t

    async def timed_env_call(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.monotonic()
        try:
            return await self.run_in_executor(func, *args, **kwargs)
        finally:
            self._timing["env_time"] += time.monotonic() - t

    def postprocess_episode(
        self, episode: Episode, termination_reason: Any = None, error: dict | None = None
    ) -> Episode:
        episode = super().postprocess_episode(episode, termination_reason, error)
        episode.info["timing"] = dict(self._timing)
        return episode

    def reset(self, task: Any = None, uid: str | None = None) -> Any:
        self._timing = {"llm_time": 0.0, "env_time": 0.0}
        return super().reset(task, uid)


def _resolve(cls_or_path: Any) -> Any:
    return import_from_string(cls_or_path) if isinstance(cls_or_path, str) else cls_or_path


class MultiTurnWorkflow(TimingTrackingMixin, Workflow):
    """rLLM's agent + environment loop: reset env, then model -> agent action -> env step, until done."""

    def __init__(self, agent_cls: Any, env_cls: Any, agent_args: dict | None = None, env_args: dict | None = None,
                 max_steps: int = 5, **kwargs: Any):
        super().__init__(**kwargs)
        self.agent = _resolve(agent_cls)(**dict(agent_args or {}))
        self.env = _resolve(env_cls)(**dict(env_args or {}))
        self.max_steps = max_steps

    async def run(self, task: dict, uid: str, **kwargs: Any) -> Episode | None:
        observation, info = await self.timed_env_call(self.reset, task=task, uid=uid)
        self.agent.update_from_env(observation, 0, False, info)
        for _ in range(self.max_steps):
            output = await self.timed_llm_call(self.agent.chat_completions, application_id=uid, **kwargs)
            action = self.agent.update_from_model(output.text)
            next_obs, reward, done, info = await self.timed_env_call(self.env.step, action)
            self.agent.update_from_env(next_obs, reward, done, info)
            if output.finish_reason == "length":
                raise TerminationEvent(TerminationReason.MAX_RESPONSE_LENGTH_EXCEEDED)
            if done:
                raise TerminationEvent(TerminationReason.ENV_DONE)
        raise TerminationEvent(TerminationReason.MAX_TURNS_EXCEEDED)

    # rLLM's MultiTurnWorkflow.reset returns the environment's (observation, info), unlike Workflow.reset.
    def reset(  # pyright: ignore[reportIncompatibleMethodOverride]
        self, task: dict | None = None, uid: str | None = None
    ) -> tuple[Any, dict]:
        super().reset(task, uid)
        return self.env.reset(task)


class SingleTurnWorkflow(MultiTurnWorkflow):
    """One model call, one environment step."""

    def __init__(
        self, agent_cls: Any, env_cls: Any, agent_args: dict | None = None, env_args: dict | None = None, **kwargs: Any
    ):
        super().__init__(agent_cls, env_cls, agent_args, env_args, max_steps=1, **kwargs)


# --- the adapter -------------------------------------------------------------------------------------
class RLLMWorkflowAdapter(RolloutWorkflow):
    """Runs an rLLM `Workflow` subclass as an mlrl RolloutWorkflow (see the module docstring)."""

    def __init__(
        self,
        workflow_cls: type[Workflow],
        *,
        tokenizer: Any,
        gconfig: GenerationHyperparameters | None = None,
        step_rewards: str = "auto",
        max_threads: int = 64,
        **workflow_kwargs: Any,
    ):
        if not (inspect.isclass(workflow_cls) and issubclass(workflow_cls, Workflow)):
            raise TypeError(f"RLLMWorkflowAdapter needs a compat.rllm.Workflow subclass, got {workflow_cls!r}")
        if step_rewards not in ("auto", "trajectory", "step"):
            raise ValueError(f"step_rewards must be 'auto', 'trajectory' or 'step', got {step_rewards!r}")
        if tokenizer is None:
            raise ValueError("an rLLM workflow needs the model's tokenizer")
        self.workflow_cls = workflow_cls
        self.tokenizer = tokenizer
        self.gconfig = (gconfig or GenerationHyperparameters()).new(n_samples=1)
        self.step_rewards = step_rewards
        self.workflow_kwargs = workflow_kwargs
        self._max_threads = max_threads
        self.executor: ThreadPoolExecutor | None = None
        self._idle: list[Workflow] = []

    def _acquire(self) -> Workflow:
        if self._idle:
            return self._idle.pop()
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=self._max_threads, thread_name_prefix="rllm-wf")
        wf = self.workflow_cls(rollout_engine=MlrlRolloutEngine(self.tokenizer, self.gconfig), executor=self.executor,
                               **self.workflow_kwargs)
        if not wf.is_multithread_safe():
            raise ValueError(f"{self.workflow_cls.__name__} holds environments that are not multithread safe")
        return wf

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> EpisodeOutput:
        wf = self._acquire()
        rollout_engine = cast(MlrlRolloutEngine, wf.rollout_engine)  # built by _acquire
        calls: list[tuple[list[dict], ModelOutput]] = []
        try:
            rollout_engine.bind(engine)
            uid = f"{uuid.uuid4().hex[:12]}:0"
            wf.uid, wf.task, wf._completed_trajectories = uid, data, []
            episode = await wf.run_with_termination_handling(task=data, uid=uid)
            calls = rollout_engine.calls
        finally:
            rollout_engine.bind(None)
            self._idle.append(wf)
        attach_model_outputs(episode, calls)
        return self.episode_to_output(episode, wf)

    def episode_to_output(self, episode: Episode, wf: Workflow) -> EpisodeOutput:
        reason = episode.termination_reason
        info = dict(episode.info)
        metrics = {k: float(v) for k, v in (episode.metrics or {}).items() if isinstance(v, (int, float))}
        if reason == TerminationReason.ERROR:
            return EpisodeOutput(status=EpisodeStatus.ERROR, termination_reason=reason, info=info, metrics=metrics)
        if reason == TerminationReason.TIMEOUT:
            return EpisodeOutput(status=EpisodeStatus.TIMEOUT, termination_reason=reason, info=info, metrics=metrics)
        mode = self.step_rewards
        if mode == "auto":
            mode = "step" if (wf.gamma > 0 or wf.reward_bonus_coeff > 0) else "trajectory"
        samples: list[Sample] = []
        skipped = 0
        for traj in episode.trajectories:
            steps = [s for s in traj.steps if s.response_ids]
            skipped += len(traj.steps) - len(steps)
            samples.extend(trajectory_to_samples(traj, steps, mode))
        if skipped:
            info["steps_without_tokens"] = skipped
        status = EpisodeStatus.COMPLETED if samples else EpisodeStatus.REJECTED
        return EpisodeOutput(samples=samples, status=status, termination_reason=reason or TerminationReason.UNKNOWN,
                             is_correct=bool(episode.is_correct), metrics=metrics, info=info)

    async def aclose(self) -> None:
        """Stop the worker threads; instances are rebuilt if the adapter is used afterwards."""
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
            self.executor = None
        self._idle.clear()


def attach_model_outputs(episode: Episode, calls: list[tuple[list[dict], ModelOutput]]) -> None:
    """Give token ids to steps an agent recorded from text only (`update_from_model(response)`):
    the engine call whose messages equal the step's conversation before its answer and whose text
    is the step's model_response (the only call with those messages, when the texts differ; else,
    with no call of those messages, the call whose text is the step's), each call used once.
    Several attempts of one prompt (rLLM's solver pattern) finish in any order: the messages alone
    would give a step another attempt's tokens under its own reward. Nothing is re-tokenized."""
    unused = list(calls)
    for traj in episode.trajectories:
        for st in traj.steps:
            if st.response_ids or not unused:
                continue
            prompt = [m for m in st.chat_completions[:-1]] if st.chat_completions else None
            text = st.model_response
            same = [c for c in unused if prompt is not None and _same_messages(c[0], prompt)]
            match = next((c for c in same if text and c[1].text == text), None)
            if match is None and len(same) == 1:
                match = same[0]
            if match is None and not same:
                match = next((c for c in unused if text and c[1].text == text), None)
            if match is None:
                continue
            unused.remove(match)
            mo = match[1]
            st.prompt_ids, st.response_ids = list(mo.prompt_ids or []), list(mo.completion_ids or [])
            st.logprobs, st.versions = list(mo.logprobs or []), list(mo.versions or [])
            if getattr(st, "model_output", None) is None and hasattr(st, "model_output"):
                st.model_output = mo  # pyright: ignore[reportAttributeAccessIssue]  # a compat Step (hasattr above)


def _same_messages(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.get("role") == y.get("role") and x.get("content") == y.get("content") for x, y in zip(a, b)
    )


def _step_versions(step: Any) -> list[int]:
    n = len(step.response_ids)
    if len(step.versions) == n:
        return [int(v) for v in step.versions]
    v = step.weight_version if getattr(step, "weight_version", None) is not None else -1
    return [int(v)] * n


def _missing_logprobs(step: Any) -> dict[str, bool]:
    """The sample's flag when a step carries no engine logprobs (`_step_logprobs` puts 0.0 there):
    mlrl.update.check_rollout_logprobs then refuses it where they would be used."""
    return {} if len(step.logprobs) == len(step.response_ids) else {"missing_logprobs": True}


def _step_logprobs(step: Any) -> list[float]:
    return (
        [float(x) for x in step.logprobs]
        if len(step.logprobs) == len(step.response_ids)
        else [0.0] * len(step.response_ids)
    )


def trajectory_to_samples(traj: Trajectory, steps: list[Any], mode: str) -> list[Sample]:
    """Samples of one trajectory (see the module docstring for the two modes)."""
    out: list[Sample] = []
    base = {"group_suffix": traj.name, "trajectory": traj.uid}
    chain: Sample | None = None
    for i, st in enumerate(steps):
        prompt = [int(t) for t in st.prompt_ids]
        resp = [int(t) for t in st.response_ids]
        reward = float(st.reward) if mode == "step" else float(traj.reward or 0.0)
        if chain is not None and mode == "trajectory" and prompt[: len(chain.tokens)] == chain.tokens:
            extra = prompt[len(chain.tokens):]
            chain = Sample(
                tokens=chain.tokens + extra + resp,
                loss_mask=chain.loss_mask + [0] * len(extra) + [1] * len(resp),
                rollout_logprobs=chain.rollout_logprobs + [0.0] * len(extra) + _step_logprobs(st),
                versions=chain.versions + [-1] * len(extra) + _step_versions(st),
                reward=reward,
                prompt_len=chain.prompt_len,
                metadata={**chain.metadata, "steps": chain.metadata["steps"] + [i],
                          **_missing_logprobs(st)},
            )
            out[-1] = chain
            continue
        chain = Sample(
            tokens=prompt + resp,
            loss_mask=[0] * len(prompt) + [1] * len(resp),
            rollout_logprobs=[0.0] * len(prompt) + _step_logprobs(st),
            versions=[-1] * len(prompt) + _step_versions(st),
            reward=reward, prompt_len=len(prompt), metadata={**base, "steps": [i], **_missing_logprobs(st)},
        )
        out.append(chain)
    for s in out:
        last = steps[s.metadata["steps"][-1]]
        mo = getattr(last, "model_output", None)
        if mo is not None and getattr(mo, "finish_reason", None) == "length":
            s.status = SampleStatus.TRUNCATED
    return out


__all__ = [
    "Action",
    "BaseAgent",
    "BaseEnv",
    "Episode",
    "MlrlRolloutEngine",
    "ModelOutput",
    "MultiTurnWorkflow",
    "RLLMWorkflowAdapter",
    "RolloutEngine",
    "SingleTurnWorkflow",
    "Step",
    "TerminationEvent",
    "TerminationReason",
    "TimingTrackingMixin",
    "Trajectory",
    "Workflow",
    "trajectory_to_samples",
]

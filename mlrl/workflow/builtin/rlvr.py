"""`rlvr`: single-turn reinforcement learning with a verifiable reward (AReaL's RLVRWorkflow).

One episode = one response: the row's `messages` go through the model's chat template, the engine
generates, the reward function scores the decoded completion (special tokens skipped) against the
row, and the result is one Sample whose loss mask covers exactly the generated tokens. The runner
runs the n episodes of a prompt as one group call (`arun_group`): one engine request samples all
n responses (vLLM's `n`), which costs one request's overhead instead of n.
Evaluation episodes (`is_evaluation()`) sample with `eval_gconfig` (default: the training sampling).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlrl.reward import AsyncRewardWrapper, get_reward_fn, reward_data
from mlrl.types import GenerationHyperparameters, ModelResponse, Sample, TerminationReason
from mlrl.workflow.api import (
    EpisodeOutput,
    EpisodeStatus,
    InferenceEngine,
    ModelRequest,
    RolloutWorkflow,
    apply_chat_template,
    is_evaluation,
    sample_from_response,
)
from mlrl.workflow.registry import register_workflow


def make_reward(reward_fn: Any, timeout_s: float, workers: int | None) -> AsyncRewardWrapper:
    """An AsyncRewardWrapper for a reward name, dotted path, function or existing wrapper."""
    if isinstance(reward_fn, AsyncRewardWrapper):
        return reward_fn
    if reward_fn is None:
        raise ValueError("workflow needs a reward function (workflow.reward)")
    return AsyncRewardWrapper(get_reward_fn(reward_fn), timeout=timeout_s, max_workers=workers)


@register_workflow("rlvr")
class RLVRWorkflow(RolloutWorkflow):
    """Single-turn generate -> reward. Row keys: `messages` (OpenAI format); the rest goes to the reward."""

    def __init__(
        self,
        reward_fn: Callable[..., float] | str | AsyncRewardWrapper,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        enable_thinking: bool | None = None,
        reward_timeout_s: float = 15.0,
        reward_workers: int | None = None,
        eval_gconfig: GenerationHyperparameters | None = None,
    ):
        if tokenizer is None:
            raise ValueError("RLVRWorkflow needs the model's tokenizer")
        self.tokenizer = tokenizer
        self.gconfig = gconfig.new(n_samples=1)
        self.eval_gconfig = (eval_gconfig or gconfig).new(n_samples=1)
        self.enable_thinking = enable_thinking
        self.reward = make_reward(reward_fn, reward_timeout_s, reward_workers)

    def prompt_ids(self, data: dict[str, Any]) -> list[int]:
        if "messages" not in data:
            raise KeyError(f"rlvr: the row has no 'messages' (keys: {sorted(data)})")
        # None: the template's own default; true / false reach it (Qwen3's renders an empty think block on false)
        kw = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        return apply_chat_template(self.tokenizer, data["messages"], add_generation_prompt=True, **kw)

    group_native = True  # the runner calls arun_group: a GRPO group's n samples come from one engine request

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Sample:
        input_ids = self.prompt_ids(data)
        gconfig = self.eval_gconfig if is_evaluation() else self.gconfig
        resp = await engine.agenerate(ModelRequest(input_ids=input_ids, gconfig=gconfig, tokenizer=self.tokenizer))
        return await self._score(input_ids, resp, data)

    async def arun_group(self, engine: InferenceEngine, data: dict[str, Any], n: int) -> list[EpisodeOutput]:
        """The n episodes of one prompt: one request for n samples (`agenerate_group`, which the
        runner's engine always offers) and one reward-pool task for their scores. An engine failure
        fails its episode only."""
        input_ids = self.prompt_ids(data)
        gconfig = (self.eval_gconfig if is_evaluation() else self.gconfig).new(n_samples=n)
        req = ModelRequest(input_ids=input_ids, gconfig=gconfig, tokenizer=self.tokenizer)
        resps = await engine.agenerate_group(req)  # type: ignore[attr-defined]
        ok = [r for r in resps if not r.stop_reason.unfinished]
        prompt = self.tokenizer.decode(input_ids, skip_special_tokens=True)
        completions = [self.tokenizer.decode(r.output_tokens, skip_special_tokens=True) for r in ok]
        row = reward_data(data)
        rewards = iter(await self.reward.score_many(  # one reward-pool round trip for the group
            [((prompt, c, r.input_tokens, r.output_tokens), row) for c, r in zip(completions, ok)]))
        scored = {id(r): sample_from_response(r, next(rewards), completion=c) for c, r in zip(completions, ok)}
        return [EpisodeOutput(samples=[scored[id(r)]]) if id(r) in scored else _engine_failure(r) for r in resps]

    async def _score(self, input_ids: list[int], resp: ModelResponse, data: dict[str, Any]) -> Sample:
        prompt = self.tokenizer.decode(input_ids, skip_special_tokens=True)
        completion = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        reward = await self.reward(prompt, completion, resp.input_tokens, resp.output_tokens, **reward_data(data))
        return sample_from_response(resp, reward, completion=completion)


def _engine_failure(resp: ModelResponse) -> EpisodeOutput:
    """The episode of a sample whose engine request failed (error or abort): an ERROR episode."""
    msg = f"engine request {resp.rid} ended with {resp.stop_reason.value}: {resp.error}"
    return EpisodeOutput(status=EpisodeStatus.ERROR, termination_reason=TerminationReason.ERROR,
                         info={"error": {"error_message": msg, "error_type": "EngineError", "traceback": ""}})

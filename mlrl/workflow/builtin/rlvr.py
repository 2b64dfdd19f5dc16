"""`rlvr`: single-turn reinforcement learning with a verifiable reward (AReaL's RLVRWorkflow).

One episode = one response: the row's `messages` go through the model's chat template, the engine
generates, the reward function scores the decoded completion (special tokens skipped) against the
row, and the result is one Sample whose loss mask covers exactly the generated tokens.
Evaluation episodes (`is_evaluation()`) sample with `eval_gconfig` (default: the training sampling).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlrl.reward import AsyncRewardWrapper, get_reward_fn, reward_data
from mlrl.types import GenerationHyperparameters, Sample
from mlrl.workflow.api import (
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
        enable_thinking: bool = False,
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
        kw = {"enable_thinking": self.enable_thinking} if self.enable_thinking else {}
        return apply_chat_template(self.tokenizer, data["messages"], add_generation_prompt=True, **kw)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Sample:
        input_ids = self.prompt_ids(data)
        gconfig = self.eval_gconfig if is_evaluation() else self.gconfig
        resp = await engine.agenerate(ModelRequest(input_ids=input_ids, gconfig=gconfig, tokenizer=self.tokenizer))
        prompt = self.tokenizer.decode(input_ids, skip_special_tokens=True)
        completion = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        reward = await self.reward(prompt, completion, resp.input_tokens, resp.output_tokens, **reward_data(data))
        return sample_from_response(resp, reward, completion=completion)

"""`openai_agent`: train an agent written against the OpenAI client (AReaL's agent workflow).

The user's agent is any object with `async def run(data, **extra_kwargs)`; it builds
`AsyncOpenAI(base_url=extra_kwargs["base_url"], api_key=extra_kwargs["api_key"],
http_client=extra_kwargs["http_client"])` and calls `chat.completions.create` as often as it
likes. Each episode opens its own proxy session (bound to the episode's engine), so the
completions it makes are recorded with their token ids, logprobs and weight versions.

Reward, in order of precedence: the agent's return value (a float rewards the last completion; a
dict {completion id: reward} rewards named completions), else rewards the agent posted to
`<base_url>/../rl/set_reward`, else the configured reward function applied to the last
completion. Then rewards are propagated backward with `turn_discount` and exported `individual`
(one sample per completion) or `concat` (see `mlrl.workflow.agent_proxy.interactions`).

Sampling: the policy's own (`rollout.sampling`), whatever temperature / top_p / top_k the agent's
requests carry: the trainer computes its logprobs at the config's temperature over the whole
softmax, so a sample drawn at another temperature is off-policy with nothing to correct it.
`sampling_overrides: true` lets the requests' values through (a warning says what it costs; the
gap shows in train/mismatch/*); max_tokens / stop always apply.
"""

from __future__ import annotations

import copy
import inspect
import logging
from typing import Any

from mlrl.reward import AsyncRewardWrapper, reward_data
from mlrl.types import GenerationHyperparameters
from mlrl.workflow.agent_proxy.proxy import OpenAIProxy, shared_http_client
from mlrl.workflow.api import EpisodeOutput, EpisodeStatus, InferenceEngine, RolloutWorkflow
from mlrl.workflow.builtin.rlvr import make_reward
from mlrl.workflow.registry import get_workflow, register_workflow

logger = logging.getLogger(__name__)


@register_workflow("openai_agent")
class OpenAIAgentWorkflow(RolloutWorkflow):
    """Wraps an agent (object, class, registered name or dotted path) into a RolloutWorkflow."""

    def __init__(
        self,
        agent: Any,
        tokenizer: Any,
        gconfig: GenerationHyperparameters | None = None,
        reward_fn: Any = None,
        export_style: str = "individual",
        turn_discount: float = 1.0,
        sampling_overrides: bool = False,
        agent_kwargs: dict[str, Any] | None = None,
        proxy: OpenAIProxy | None = None,
        reward_timeout_s: float = 15.0,
        reward_workers: int | None = None,
        tool_call_format: str = "auto",
    ):
        """`tool_call_format`: how the proxy finds tool calls in the model's text when a request
        has `tools` ("auto": the format the chat template renders, "hermes", "llama3_json", or
        "none": the text only; mlrl.workflow.agent_proxy.tool_calls)."""
        if tokenizer is None:
            raise ValueError("openai_agent needs the model's tokenizer (the proxy applies the chat template)")
        if export_style not in ("individual", "concat"):
            raise ValueError(f"openai_agent: export_style must be 'individual' or 'concat', got {export_style!r}")
        if isinstance(agent, str):
            agent = get_workflow(agent)
        if inspect.isclass(agent):
            agent = agent(**(agent_kwargs or {}))
        run = getattr(agent, "run", None)
        if run is None or not inspect.iscoroutinefunction(run):
            raise TypeError(f"openai_agent: {type(agent).__name__} needs `async def run(self, data, **extra_kwargs)`")
        self.agent = agent
        self.tokenizer = tokenizer
        self.gconfig = (gconfig or GenerationHyperparameters()).new(n_samples=1)
        self.reward: AsyncRewardWrapper | None = (
            make_reward(reward_fn, reward_timeout_s, reward_workers) if reward_fn is not None else None
        )
        self.export_style = export_style
        self.turn_discount = turn_discount
        self.sampling_overrides = sampling_overrides
        if sampling_overrides:
            logger.warning("openai_agent: sampling_overrides=true: requests' own temperature / top_p / top_k reach "
                           "the engines, but the trainer's logprobs use rollout.sampling's; samples drawn otherwise "
                           "are off-policy (train/mismatch/* shows the gap)")
        self.proxy = proxy or OpenAIProxy(tokenizer, default_gconfig=self.gconfig, tool_call_format=tool_call_format)
        self._owns_proxy = proxy is None

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> EpisodeOutput:
        if not self.proxy.started:
            await self.proxy.start()
        session = self.proxy.start_session(engine, self.gconfig, sampling_overrides=self.sampling_overrides)
        try:
            result = await self.agent.run(
                copy.deepcopy(data),
                base_url=session.base_url,
                api_key=session.api_key,
                http_client=shared_http_client(),
            )
        finally:
            self.proxy.end_session(session.id)
        log = session.log
        last = log.last
        if last is None:
            return EpisodeOutput(status=EpisodeStatus.REJECTED, info={"reason": "the agent made no model call"})
        if isinstance(result, bool) or isinstance(result, (int, float)):
            log.set_last_reward(float(result))
        elif isinstance(result, dict):
            for cid, r in result.items():
                log.set_reward(cid, float(r))
        elif result is not None:
            raise TypeError(
                f"agent.run returned {type(result).__name__}; expected a float, a dict {{completion id: reward}} or "
                "None"
            )
        elif all(i.reward is None for i in log):
            if self.reward is None:
                logger.warning(
                    "agent returned no reward, set none through the proxy, and no reward function is configured: 0.0"
                )
            else:
                prompt = self.tokenizer.decode(last.model_response.input_tokens, skip_special_tokens=True)
                r = await self.reward(
                    prompt,
                    last.text,
                    last.model_response.input_tokens,
                    last.model_response.output_tokens,
                    **reward_data(data),
                )
                log.set_last_reward(r)
        final = float(last.reward or 0.0)
        log.apply_reward_discount(self.turn_discount)
        return EpisodeOutput(samples=log.export_samples(self.export_style), is_correct=final > 0,
                             metrics={"num_model_calls": float(len(log)),
                                      "num_template_splits": float(log.template_splits()),
                                      "num_tool_calls": float(session.num_tool_calls),
                                      "num_tool_call_parse_failures": float(len(session.tool_call_failures))})

    async def aclose(self) -> None:
        if self._owns_proxy:
            await self.proxy.aclose()

"""The native workflow API, in AReaL's shape: `RolloutWorkflow.arun_episode(engine, data)` turns one
dataset row into scored, trainable sequences by awaiting `engine.agenerate(ModelRequest)`.

What an episode may return (the runner converts it with `mlrl.workflow.samples.to_samples`):
- `None`: the episode is rejected (counted, nothing trained on);
- a `Sample`, or a list of them;
- AReaL's dict: `input_ids`, `loss_mask`, `logprobs`, `versions`, `rewards` (+ optional
  `attention_mask`), as lists or torch tensors, with or without the leading batch dimension —
  or a list of such dicts;
- named interactions `{completion_id: Interaction}` (what the OpenAI proxy records);
- `EpisodeOutput`, when the workflow also reports a termination reason, correctness or metrics.

Rules of the road (AReaL's): await all I/O; put expensive setup in `__init__` (one instance
serves every concurrent episode); wrap reward functions in `AsyncRewardWrapper`.
Optional hooks the runner honours: `group_native = True` with `arun_group(engine, data, n)` for
workflows that produce all n samples of a prompt in one run (Trinity's repeatable workflows; it
may return one result or a list of `EpisodeOutput`, one per episode), and `aclose()`.
"""

from __future__ import annotations

import contextvars
from abc import ABC, abstractmethod
from typing import Any

from mlrl.data.tokenizer import (  # re-exported: AReaL's names, users import them from here
    apply_chat_template,
    load_hf_tokenizer,
)
from mlrl.interfaces import EpisodeResult, InferenceEngine
from mlrl.types import (  # EpisodeOutput / EpisodeStatus live with the other plain data types
    EpisodeOutput,
    EpisodeStatus,
    GenerationHyperparameters,
    ModelRequest,
    ModelResponse,
    Row,
    Sample,
    StopReason,
)

EVALUATION: contextvars.ContextVar[bool] = contextvars.ContextVar("mlrl_evaluation", default=False)


def is_evaluation() -> bool:
    """True inside episodes the runner runs for evaluation (`run_batch(..., evaluation=True)`);
    AReaL's `workflow_context.get().is_eval`."""
    return EVALUATION.get()


class RolloutWorkflow(ABC):
    """Base class of native workflows (AReaL's `areal.api.workflow_api.RolloutWorkflow`)."""

    group_native: bool = False  # True: the runner calls arun_group(engine, data, n) once per prompt

    @abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: Row) -> EpisodeResult:
        """Run one episode on `data` (a dataset row) and return its trainable result, or None to reject it."""
        raise NotImplementedError


def gconfig_from_sampling(sampling: Any) -> GenerationHyperparameters:
    """GenerationHyperparameters from `mlrl.config.schema.SamplingConfig` (temperature 0 = greedy)."""
    return GenerationHyperparameters(
        n_samples=1,
        max_new_tokens=int(sampling.max_new_tokens),
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        top_k=int(sampling.top_k),
        greedy=float(sampling.temperature) == 0.0,
        stop=list(getattr(sampling, "stop", None) or []),
        stop_token_ids=[int(t) for t in getattr(sampling, "stop_token_ids", None) or []],
    )


def sample_from_response(resp: ModelResponse, reward: float, **metadata: Any) -> Sample:
    """One single-turn sample: prompt (masked out) followed by the response (trained on)."""
    p, r = resp.input_len, resp.output_len
    if len(resp.output_logprobs) != r or len(resp.output_versions) != r:
        raise ValueError(
            f"ModelResponse has {r} output tokens but {len(resp.output_logprobs)} logprobs and "
            f"{len(resp.output_versions)} versions (an engine must return one of each per token)"
        )
    from mlrl.types import SampleStatus

    return Sample(
        tokens=list(resp.input_tokens) + list(resp.output_tokens),
        loss_mask=[0] * p + [1] * r,
        rollout_logprobs=[0.0] * p + [float(x) for x in resp.output_logprobs],
        versions=[-1] * p + [int(v) for v in resp.output_versions],
        reward=float(reward),
        prompt_len=p,
        status=SampleStatus.TRUNCATED if resp.stop_reason == StopReason.LENGTH else SampleStatus.COMPLETED,
        metadata=dict(metadata),
    )


__all__ = [
    "EpisodeOutput",
    "EpisodeStatus",
    "GenerationHyperparameters",
    "InferenceEngine",
    "ModelRequest",
    "ModelResponse",
    "RolloutWorkflow",
    "apply_chat_template",
    "gconfig_from_sampling",
    "is_evaluation",
    "load_hf_tokenizer",
    "sample_from_response",
]

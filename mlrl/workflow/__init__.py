"""Workflows: how one dataset row becomes scored, trainable trajectories.

Native API (AReaL's shape): subclass `RolloutWorkflow`, implement
`async def arun_episode(self, engine, data)`, call `await engine.agenerate(ModelRequest(...))`,
return samples (or None to reject). Register with `@register_workflow("name")` or name the
class by dotted path in `workflow.name`. `EpisodeRunner` runs the episodes of an RL step
(groups, concurrency, timeouts, failures).

Layout, one concern per module:
- `api`: the user-facing API (`RolloutWorkflow`, `ModelRequest`, `EpisodeOutput`, helpers;
  `apply_chat_template` / `load_hf_tokenizer` are re-exported from `mlrl.data.tokenizer`);
- `samples`: what an episode may return -> `Sample`s; `runner`: `EpisodeRunner`, `summarize`;
- `registry`: `workflow.name` -> one workflow instance;
- `builtin/`: the built-in workflows `rlvr`, `multi_turn`, `openai_agent` (registered on first lookup);
- `agent_proxy/`: the OpenAI-compatible recording proxy and the `Interaction`s it records;
- `compat/`: Trinity-RFT and rLLM workflows run through `mlrl.workflow.compat.trinity` / `.rllm`.
Layering: `mlrl.workflow` may import `mlrl.data`, never the reverse. Test doubles (the scripted
engine) live under tests/helpers, not here.
"""

from mlrl.reward import AsyncRewardWrapper
from mlrl.types import GenerationHyperparameters, ModelResponse, Sample, StopReason
from mlrl.workflow.api import (
    EpisodeOutput,
    EpisodeStatus,
    InferenceEngine,
    ModelRequest,
    RolloutWorkflow,
    apply_chat_template,
    gconfig_from_sampling,
    is_evaluation,
    load_hf_tokenizer,
    sample_from_response,
)
from mlrl.workflow.registry import (
    build_workflow,
    build_workflow_from_config,
    get_workflow,
    list_workflows,
    register_workflow,
)
from mlrl.workflow.runner import BatchResult, EpisodeResult, EpisodeRunner, GroupResult, summarize
from mlrl.workflow.samples import WorkflowResultError, to_samples

__all__ = [
    "AsyncRewardWrapper",
    "BatchResult",
    "EpisodeOutput",
    "EpisodeResult",
    "EpisodeRunner",
    "EpisodeStatus",
    "GenerationHyperparameters",
    "GroupResult",
    "InferenceEngine",
    "ModelRequest",
    "ModelResponse",
    "RolloutWorkflow",
    "Sample",
    "StopReason",
    "WorkflowResultError",
    "apply_chat_template",
    "build_workflow",
    "build_workflow_from_config",
    "gconfig_from_sampling",
    "get_workflow",
    "is_evaluation",
    "list_workflows",
    "load_hf_tokenizer",
    "register_workflow",
    "sample_from_response",
    "summarize",
    "to_samples",
]

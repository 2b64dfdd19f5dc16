"""Workflows: how one dataset row becomes scored, trainable trajectories.

Native API (AReaL's shape): subclass `RolloutWorkflow`, implement
`async def arun_episode(self, engine, data)`, call `await engine.agenerate(ModelRequest(...))`,
return samples (or None to reject). Register with `@register_workflow("name")` or name the
class by dotted path in `workflow.name`. Built-ins: `rlvr`, `multi_turn`, `openai_agent`.
Trinity-RFT and rLLM workflows run through `mlrl.workflow.compat.trinity` / `.rllm`.
`EpisodeRunner` runs the episodes of an RL step (groups, concurrency, timeouts, failures).
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
from mlrl.workflow.registry import build_workflow, build_workflow_from_config, get_workflow, list_workflows, register_workflow
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

"""Workflow registry and construction: `workflow.name` in the config is a registered name
(`@register_workflow("name")`, or Trinity's `@WORKFLOWS.register_module("name")` of ported code)
or a dotted path `pkg.module.Class`; `build_workflow` turns it into
one `RolloutWorkflow` instance, built once per run (never per episode).

What a name may resolve to, and what it becomes:
- a `RolloutWorkflow` subclass (or any class with `arun_episode`): instantiated with the
  configured kwargs plus, when its `__init__` asks for them, `tokenizer`, `gconfig`,
  `reward_fn` (the raw function named by `workflow.reward`), `reward_timeout_s`, `reward_workers`;
- a Trinity-style `mlrl.workflow.compat.trinity.Workflow` subclass: wrapped in
  `TrinityWorkflowAdapter`;
- an rLLM-style `mlrl.workflow.compat.rllm.Workflow` subclass: wrapped in `RLLMWorkflowAdapter`;
- any other class or object with `async def run(data, **extra_kwargs)`: an agent, wrapped in
  `OpenAIAgentWorkflow` (it talks to the model through the OpenAI-compatible proxy).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from mlrl.registry import LookupFailed, Registry
from mlrl.registry import qualified_name as _qual
from mlrl.reward import get_reward_fn, import_from_string
from mlrl.types import GenerationHyperparameters

T = TypeVar("T")

_WORKFLOWS: Registry[Any] = Registry("workflow")


def register_workflow(name: str) -> Callable[[T], T]:
    """Decorator: `@register_workflow("my_flow")` on a workflow class (or an agent class)."""
    return _WORKFLOWS.register(name)


def list_workflows() -> list[str]:
    _ensure_builtins()
    return _WORKFLOWS.names()


def _ensure_builtins() -> None:
    # The built-ins register themselves on import; importing them lazily keeps `import mlrl.workflow` light.
    from mlrl.workflow.builtin import agent, multi_turn, rlvr  # noqa: F401


def get_workflow(name_or_path: str) -> Any:
    """The registered class/object for `name_or_path`, or the object at a dotted path."""
    _ensure_builtins()
    found = _WORKFLOWS.get(name_or_path)
    if found is not None:
        return found
    from mlrl.workflow.compat.trinity import WORKFLOWS as TRINITY_WORKFLOWS

    if TRINITY_WORKFLOWS.get(name_or_path) is not None:  # @WORKFLOWS.register_module("name") of ported Trinity code
        return TRINITY_WORKFLOWS.get(name_or_path)
    if "." in name_or_path or ":" in name_or_path:
        return import_from_string(name_or_path)
    raise LookupFailed(f"workflow.name: unknown workflow {name_or_path!r}; registered: {', '.join(_WORKFLOWS.names())}")


def _accepts(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def _is_agent(obj: Any) -> bool:
    run = getattr(obj, "run", None)
    return run is not None and inspect.iscoroutinefunction(run) and not hasattr(obj, "arun_episode")


def build_workflow(
    spec: Any,
    *,
    kwargs: dict[str, Any] | None = None,
    tokenizer: Any = None,
    gconfig: GenerationHyperparameters | None = None,
    reward: Any = None,
    reward_timeout_s: float = 30.0,
    reward_workers: int | None = None,
) -> Any:
    """One workflow instance (with `arun_episode`) for `spec`: a name, dotted path, class or instance."""
    from mlrl.workflow.compat import rllm as rllm_compat
    from mlrl.workflow.compat import trinity as trinity_compat

    kwargs = dict(kwargs or {})
    obj = get_workflow(spec) if isinstance(spec, str) else spec
    reward_fn = get_reward_fn(reward) if reward is not None else None
    context = {
        "tokenizer": tokenizer,
        "gconfig": gconfig if gconfig is not None else GenerationHyperparameters(),
        "reward_fn": reward_fn,
        "reward_timeout_s": reward_timeout_s,
        "reward_workers": reward_workers,
    }

    if inspect.isclass(obj) and issubclass(obj, trinity_compat.Workflow):
        return _construct(spec, trinity_compat.TrinityWorkflowAdapter, context, kwargs, obj)
    if inspect.isclass(obj) and issubclass(obj, rllm_compat.Workflow):
        return _construct(spec, rllm_compat.RLLMWorkflowAdapter, context, kwargs, obj)
    if hasattr(obj, "arun_episode"):
        if inspect.isclass(obj):
            return _construct(spec, obj, context, kwargs)
        if kwargs:
            raise LookupFailed(f"workflow.kwargs given for an already-built workflow instance {_qual(type(obj))}")
        return obj
    if _is_agent(obj):
        from mlrl.workflow.builtin.agent import OpenAIAgentWorkflow

        agent_kwargs = kwargs.pop("agent_kwargs", {})
        agent = obj(**agent_kwargs) if inspect.isclass(obj) else obj
        return _construct(spec, OpenAIAgentWorkflow, context, kwargs, agent)
    if callable(obj) and not inspect.isclass(obj):  # a registered factory function
        built = _construct(spec, obj, context, kwargs)
        if not hasattr(built, "arun_episode"):
            raise LookupFailed(
                f"workflow factory {_qual(obj)} returned {type(built).__name__}, which has no arun_episode"
            )
        return built
    raise LookupFailed(
        f"workflow {spec!r} resolves to {_qual(obj)}, which is neither a RolloutWorkflow (arun_episode), "
        "a Trinity or rLLM Workflow subclass, nor an agent with `async def run(data, **extra_kwargs)`"
    )


def _construct(spec: Any, target: Any, context: dict[str, Any], kwargs: dict[str, Any], *args: Any) -> Any:
    try:
        return target(*args, **_pick(target, context, kwargs))
    except TypeError as e:
        raise LookupFailed(f"workflow {spec!r} could not be built with {_qual(target)}: {e} "
                         "(constructor arguments come from workflow.kwargs; reward_fn from workflow.reward)") from e


def _pick(target: Any, context: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """kwargs plus the context entries `target.__init__` (or the function) declares and kwargs lack."""
    fn = target.__init__ if inspect.isclass(target) else target
    out = dict(kwargs)
    for name, value in context.items():
        if name not in out and value is not None and _accepts(fn, name):
            out[name] = value
    return out


def build_workflow_from_config(cfg: Any, *, tokenizer: Any, gconfig: GenerationHyperparameters,
                               reward: Any = None) -> Any:
    """`build_workflow` from `mlrl.config.schema.WorkflowConfig` (name, reward, kwargs, reward pool
    settings); `reward`, a reward function, replaces workflow.reward (a data mixture's dispatcher)."""
    return build_workflow(
        cfg.name,
        kwargs=cfg.kwargs,
        tokenizer=tokenizer,
        gconfig=gconfig,
        reward=cfg.reward if reward is None else reward,
        reward_timeout_s=cfg.reward_timeout_s,
        reward_workers=cfg.reward_workers,
    )

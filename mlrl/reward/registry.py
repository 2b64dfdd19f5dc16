"""Registry of reward functions, looked up by the name in `workflow.reward` or by a dotted path.

A reward function has AReaL's signature

    fn(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], **data) -> float

where `data` is the dataset row (its `answer` and any metadata), so a function picks the keys it
needs and ignores the rest. Registered functions must live at module level: the reward process
pool pickles them by reference.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from mlrl.registry import LookupFailed, Registry

if TYPE_CHECKING:  # (mlrl.interfaces imports torch; reward worker processes stay light)
    from mlrl.interfaces import RewardFn

F = TypeVar("F", bound=Callable[..., Any])

_REWARDS: Registry[RewardFn] = Registry("reward")

RESERVED_ARGS = ("prompt", "completions", "prompt_ids", "completion_ids")


def reward_data(data: dict[str, Any]) -> dict[str, Any]:
    """The row's fields as reward keyword arguments, minus the four positional names a row may
    also use (a `prompt` column would otherwise collide with the `prompt` argument)."""
    return {k: v for k, v in data.items() if k not in RESERVED_ARGS}


INLINE_ATTR = "mlrl_inline"


def register_reward(name: str, *, inline: bool = False) -> Callable[[F], F]:
    """Decorator: `@register_reward("my_reward")` makes `workflow.reward=my_reward` find the function.

    `inline=True` declares the function pure and cheap (string comparison, microseconds, cannot
    hang): `AsyncRewardWrapper` then calls it in the driver's own thread instead of sending it to
    the reward process pool, whose round trip costs far more than such a function (measured on
    the CPU demo: ~0.6 ms of IPC per group, 0.04 s per step). No timeout applies to an inline call;
    an exception still scores 0.0 and counts as a failure."""
    register = _REWARDS.register(name)

    def deco(fn: F) -> F:
        register(fn)
        if inline:
            setattr(fn, INLINE_ATTR, True)
        return fn

    return deco


def is_inline(fn: Any) -> bool:
    """Whether `fn` was registered with `inline=True` (see register_reward)."""
    return bool(getattr(fn, INLINE_ATTR, False))


def import_from_string(path: str) -> Any:
    """`pkg.module.attr` or `pkg.module:attr` -> the object (clear error when missing)."""
    if ":" in path:
        mod_name, _, attr = path.partition(":")
    else:
        mod_name, _, attr = path.rpartition(".")
    if not mod_name or not attr:
        raise LookupFailed(f"{path!r} is not a dotted path of the form pkg.module.name")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise LookupFailed(f"cannot import module {mod_name!r} (from {path!r}): {e}") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise LookupFailed(f"module {mod_name!r} has no attribute {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    return obj


def get_reward_fn(name_or_path: str | RewardFn) -> RewardFn:
    """A registered reward by name, a function by dotted path, or the callable itself."""
    if callable(name_or_path):
        return name_or_path
    if not isinstance(name_or_path, str) or not name_or_path:
        raise LookupFailed(f"workflow.reward: expected a reward name or dotted path, got {name_or_path!r}")
    fn = _REWARDS.get(name_or_path)
    if fn is not None:
        return fn
    if "." in name_or_path or ":" in name_or_path:
        fn = import_from_string(name_or_path)
        if not callable(fn):
            raise LookupFailed(f"workflow.reward: {name_or_path!r} is not callable")
        return cast("RewardFn", fn)
    raise LookupFailed(f"workflow.reward: unknown reward {name_or_path!r}; registered: {', '.join(list_rewards())}")


def list_rewards() -> list[str]:
    return _REWARDS.names()

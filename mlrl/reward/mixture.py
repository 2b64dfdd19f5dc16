"""The reward of a prompt mixture (`data.mix`): each row's `data_source` picks its source's reward.

One picklable callable, handed to the workflow as its `reward_fn` like any other reward: the
reward process pool pickles it by reference to this class and its sources' functions (all module
level), and it is inline (called in the driver, no pool) only when every source's reward is."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from mlrl.registry import LookupFailed
from mlrl.reward.registry import INLINE_ATTR, get_reward_fn, is_inline

SOURCE_KEY = "data_source"  # (mlrl.data.rows.SOURCE_KEY: the rows' tag; mlrl.reward stays below mlrl.data)


class SourceReward:
    """`fn(prompt, completions, prompt_ids, completion_ids, **row)`: the reward of the row's source."""

    def __init__(self, names: Mapping[str, str]):
        """`names`: source -> reward name or dotted path (a lookup failure names the source)."""
        self.names = dict(names)
        self.fns: dict[str, Any] = {}
        for source, name in self.names.items():
            try:
                fn = get_reward_fn(name)
            except LookupFailed as e:  # (its message names workflow.reward, the usual field)
                why = str(e).removeprefix("workflow.reward: ")
                raise LookupFailed(f"the reward of data.mix source {source!r} ({name}): {why}") from None
            if inspect.iscoroutinefunction(fn):
                raise LookupFailed(f"the reward of data.mix source {source!r}: {name} is an async function; a "
                                   "mixture's rewards are called per row by one dispatcher: plain functions only")
            self.fns[source] = fn
        if all(is_inline(fn) for fn in self.fns.values()):
            setattr(self, INLINE_ATTR, True)

    def __call__(self, prompt: Any, completions: Any, prompt_ids: Any, completion_ids: Any, **data: Any) -> Any:
        source = data.get(SOURCE_KEY)
        fn = self.fns.get(source) if isinstance(source, str) else None
        if fn is None:
            raise ValueError(f"the row's {SOURCE_KEY}={source!r} is not a source of data.mix ({', '.join(self.fns)})")
        return fn(prompt, completions, prompt_ids, completion_ids, **data)

    def __repr__(self) -> str:
        return "data.mix rewards (" + ", ".join(f"{s}: {n}" for s, n in self.names.items()) + ")"

"""The name -> object tables behind `@register_reward`, `@register_workflow` and
`@register_dataset`: one rule for all three.

A name is taken once. Registering the same object again, or one with the same qualified name (its
module imported a second time, e.g. reloaded), replaces the entry silently; another object under a
taken name is an error that names the holder, so two user modules cannot shadow each other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
F = TypeVar("F")


class LookupFailed(ValueError):
    """A configured name (workflow.name, workflow.reward, workflow.kwargs) that resolves to nothing
    usable: a mistake in the config, reported in one line. Errors raised inside the user's own code
    are not wrapped in it and keep their traceback."""


def qualified_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


class Registry(Generic[T]):
    """Registered `T`s by name; `kind` ("reward", "workflow", "dataset") words the errors."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, check_name: Callable[[str], bool] | None = None) -> Callable[[F], F]:
        """Decorator putting its target under `name` (a non-empty string, and `check_name(name)`
        when given)."""
        if not isinstance(name, str) or not name or (check_name is not None and not check_name(name)):
            raise ValueError(f"register_{self.kind}: invalid name {name!r}")

        def deco(obj: F) -> F:
            prev = self._entries.get(name)
            if prev is not None and prev is not obj and qualified_name(prev) != qualified_name(obj):
                raise ValueError(f"{self.kind} {name!r} is already registered to {qualified_name(prev)}")
            self._entries[name] = obj  # pyright: ignore[reportArgumentType]  (F is the registry's T)
            return obj

        return deco

    def get(self, name: str) -> T | None:
        return self._entries.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def names(self) -> list[str]:
        return sorted(self._entries)

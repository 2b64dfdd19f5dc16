"""Helpers shared by the workflow tests (a uniquely named module: `conftest` is not importable safely
when several test folders have one)."""


def last_user_word(prompt: str) -> str:
    """The word before the final ' . assistant :' of a tiny-template prompt ('user : copy 7 . assistant :' -> '7')."""
    return prompt.split()[-4]


def count_calls(monkeypatch, owner, name: str, seen: dict, key: str) -> None:
    """Wrap `owner.name` (a sync or async method) so that each call adds 1 to `seen[key]`."""
    import inspect

    fn = getattr(owner, name)
    if inspect.iscoroutinefunction(fn):
        async def wrapped(*a, **kw):
            seen[key] += 1
            return await fn(*a, **kw)
    else:
        def wrapped(*a, **kw):
            seen[key] += 1
            return fn(*a, **kw)
    monkeypatch.setattr(owner, name, wrapped)

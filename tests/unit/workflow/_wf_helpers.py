"""Helpers shared by the workflow tests (a uniquely named module: `conftest` is not importable safely
when several test folders have one)."""


def last_user_word(prompt: str) -> str:
    """The word before the final ' . assistant :' of a tiny-template prompt ('user : copy 7 . assistant :' -> '7')."""
    return prompt.split()[-4]

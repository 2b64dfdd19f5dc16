"""Shared fixtures of the workflow tests: the tiny model's tokenizer and a scripted engine factory."""

import pytest

from mlrl.reward import AsyncRewardWrapper
from mlrl.workflow import load_hf_tokenizer


@pytest.fixture(scope="session")
def tok():
    return load_hf_tokenizer("builtin:tiny-llama")


@pytest.fixture(scope="session", autouse=True)
def _reward_pools():
    yield
    AsyncRewardWrapper.shutdown_pools()


def last_user_word(prompt: str) -> str:
    """The word before the final ' . assistant :' of a tiny-template prompt ('user : copy 7 . assistant :' -> '7')."""
    words = prompt.split()
    return words[-4]

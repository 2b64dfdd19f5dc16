"""Shared fixtures of the workflow tests: the tiny model's tokenizer; reward pools shut down at the end."""

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


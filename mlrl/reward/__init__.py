"""Rewards: the registry (`register_reward`, `get_reward_fn`), `AsyncRewardWrapper` (process pool,
timeout -> 0.0), and the built-ins `exact_match`, `boxed`, `gsm8k`, `math_verify` (the last three check
answers with math-verify; `math_equal` is that check for custom rewards) and `code_tests` (runs the
completion's program against the row's tests, mlrl.reward.code).

Signature of every reward function (AReaL's):
    fn(prompt, completions, prompt_ids, completion_ids, **data) -> float
"""

from typing import TYPE_CHECKING

from mlrl.reward import builtin as _builtin  # noqa: F401  (registers the built-ins)
from mlrl.reward import code as _code  # noqa: F401  (registers code_tests)
from mlrl.reward import model as _model  # noqa: F401  (registers reward_model, the served judge)
from mlrl.reward.builtin import extract_boxed, extract_final_number, final_answer_text, math_equal, parse_number
from mlrl.reward.registry import get_reward_fn, import_from_string, list_rewards, register_reward, reward_data
from mlrl.reward.wrapper import (
    GLOBAL_REWARD_STATS,
    AsyncRewardWrapper,
    RewardStats,
    collect_reward_stats,
    default_max_workers,
)

if TYPE_CHECKING:
    from mlrl.interfaces import RewardFn


def __getattr__(name: str):
    """`RewardFn` (the Protocol in mlrl.interfaces), imported on first use: mlrl.interfaces imports
    torch, which the reward worker processes never need."""
    if name == "RewardFn":
        from mlrl.interfaces import RewardFn

        return RewardFn
    raise AttributeError(f"module 'mlrl.reward' has no attribute {name!r}")


__all__ = [
    "AsyncRewardWrapper",
    "GLOBAL_REWARD_STATS",
    "RewardFn",
    "RewardStats",
    "collect_reward_stats",
    "default_max_workers",
    "extract_boxed",
    "extract_final_number",
    "final_answer_text",
    "get_reward_fn",
    "import_from_string",
    "list_rewards",
    "math_equal",
    "parse_number",
    "register_reward",
    "reward_data",
]

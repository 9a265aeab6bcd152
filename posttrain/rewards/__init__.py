"""posttrain.rewards: the reward-function interface, length penalties and built-in rewards."""

from posttrain.rewards.base import (
    RewardComposer,
    RewardError,
    RewardFunction,
    RewardOutput,
    RewardSpec,
    RewardValueError,
    call_with_timeout,
    load_reward_function,
    required_columns,
    reward_columns,
    score_rollout,
    unpad,
)
from posttrain.rewards.length import length_penalty, overlong_penalty

__all__ = [
    "RewardComposer",
    "RewardError",
    "RewardFunction",
    "RewardOutput",
    "RewardSpec",
    "RewardValueError",
    "call_with_timeout",
    "length_penalty",
    "load_reward_function",
    "overlong_penalty",
    "required_columns",
    "reward_columns",
    "score_rollout",
    "unpad",
]

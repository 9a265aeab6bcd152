"""posttrain.rewards: the reward-function interface, length penalties and built-in rewards."""

from posttrain.rewards.base import RewardComposer, RewardFunction, RewardOutput, RewardSpec, load_reward_function
from posttrain.rewards.length import length_penalty, overlong_penalty

__all__ = [
    "RewardComposer",
    "RewardFunction",
    "RewardOutput",
    "RewardSpec",
    "length_penalty",
    "load_reward_function",
    "overlong_penalty",
]

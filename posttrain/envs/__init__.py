"""posttrain.envs: multi-turn episodes with an environment (a calculator, Python in the sandbox, function
tools), the model's tokens kept as sampled and the environment's masked out of training."""

from posttrain.envs.base import (
    ENDS,
    ENVIRONMENT_REWARD,
    UNSCORED,
    EnvConfig,
    Environment,
    EpisodeState,
    StepResult,
    data_specs,
    episode_reward,
    prompt_messages,
    with_environment_reward,
)
from posttrain.envs.episodes import followup_ids, run_episodes
from posttrain.envs.registry import build_environment, environment_for

__all__ = [
    "ENDS",
    "ENVIRONMENT_REWARD",
    "UNSCORED",
    "EnvConfig",
    "Environment",
    "EpisodeState",
    "StepResult",
    "build_environment",
    "data_specs",
    "environment_for",
    "episode_reward",
    "followup_ids",
    "prompt_messages",
    "run_episodes",
    "with_environment_reward",
]

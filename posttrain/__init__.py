"""posttrain: post-training for language models (SFT, reward models, DPO, RLHF-PPO, GRPO).

Importing the package is cheap: ``posttrain.core`` needs torch only, and the heavier layers
(``models``, ``data``, ``rollout``, ``trainers``) are imported by name when used.

Every config class has one import place here, each imported when first named::

    from posttrain import GRPOConfig, ModelConfig, DataConfig, OptimConfig, RunConfig, SamplingParams
    from posttrain.trainers import grpo   # grpo.train(config)
"""

import importlib

# The one place the version is written: pyproject.toml reads it from here; semantic versioning, each
# release in CHANGELOG.md.
__version__ = "0.2.0"

# {name: the module that defines it}: the trainers' configs and the sections they are made of
CONFIGS = {
    "SFTConfig": "posttrain.trainers.sft",
    "RMConfig": "posttrain.trainers.rm",
    "PRMConfig": "posttrain.trainers.prm",
    "DPOConfig": "posttrain.trainers.dpo",
    "KTOConfig": "posttrain.trainers.kto",
    "OnlineDPOConfig": "posttrain.trainers.online_dpo",
    "PPOConfig": "posttrain.trainers.ppo",
    "GRPOConfig": "posttrain.trainers.grpo",
    "DistillConfig": "posttrain.trainers.distill",
    "ModelConfig": "posttrain.models.loading",
    "DataConfig": "posttrain.data.datasets",
    "OptimConfig": "posttrain.runtime.config",
    "RunConfig": "posttrain.runtime.config",
    "SamplingParams": "posttrain.rollout.base",
    "RolloutConfig": "posttrain.rollout.engines",
    "ScoringConfig": "posttrain.rollout.engines",
    "RewardSpec": "posttrain.rewards.base",
    "EnvConfig": "posttrain.envs.base",
    "ProcessRewardConfig": "posttrain.rewards.process",
    "EntropyControlConfig": "posttrain.runtime.entropy_control",
    "EvalConfig": "posttrain.monitor.evaluate",
    "AlertConfig": "posttrain.monitor.alerts",
    "load_config": "posttrain.runtime.config",
}

__all__ = ["__version__", *CONFIGS]


def __getattr__(name: str):
    if name not in CONFIGS:
        raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
    return getattr(importlib.import_module(CONFIGS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *CONFIGS])

"""posttrain.rollout: sampling responses (transformers generate, the lean loop; vLLM colocated or as a server)."""

from posttrain.rollout.base import (
    Rollout,
    RolloutEngine,
    SamplingParams,
    concat_rollouts,
    left_pad,
    response_mask_from_ends,
)
from posttrain.rollout.engines import RolloutConfig, build_engine, choose_engine
from posttrain.rollout.hf import HFEngine, eos_token_ids, ignored_checkpoint_sampling
from posttrain.rollout.lean import LeanEngine

__all__ = [
    "HFEngine",
    "LeanEngine",
    "Rollout",
    "RolloutConfig",
    "RolloutEngine",
    "SamplingParams",
    "build_engine",
    "choose_engine",
    "concat_rollouts",
    "eos_token_ids",
    "ignored_checkpoint_sampling",
    "left_pad",
    "response_mask_from_ends",
]

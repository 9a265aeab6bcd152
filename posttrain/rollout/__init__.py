"""posttrain.rollout: sampling responses from the policy (transformers generate, the lean loop; vLLM on GPUs)."""

from posttrain.rollout.base import (
    Rollout,
    RolloutEngine,
    SamplingParams,
    concat_rollouts,
    left_pad,
    response_mask_from_ends,
)
from posttrain.rollout.hf import HFEngine, eos_token_ids
from posttrain.rollout.lean import LeanEngine

ROLLOUT_ENGINES = {"hf": HFEngine, "lean": LeanEngine}

__all__ = [
    "ROLLOUT_ENGINES",
    "HFEngine",
    "LeanEngine",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "concat_rollouts",
    "eos_token_ids",
    "left_pad",
    "response_mask_from_ends",
]

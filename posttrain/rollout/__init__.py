"""posttrain.rollout: sampling responses from the policy (Hugging Face generate; vLLM on GPUs)."""

from posttrain.rollout.base import (
    Rollout,
    RolloutEngine,
    SamplingParams,
    concat_rollouts,
    left_pad,
    response_mask_from_ends,
)
from posttrain.rollout.hf import HFEngine, eos_token_ids

__all__ = [
    "HFEngine",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "concat_rollouts",
    "eos_token_ids",
    "left_pad",
    "response_mask_from_ends",
]

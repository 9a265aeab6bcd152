"""posttrain.rollout: sampling responses (transformers generate, the lean loop; vLLM colocated or as a server)."""

from posttrain.rollout.base import (
    Rollout,
    RolloutEngine,
    SamplingParams,
    TokenScorer,
    concat_rollouts,
    left_pad,
    response_mask_from_ends,
    scored_logprobs,
)
from posttrain.rollout.engines import RolloutConfig, ScoringConfig, build_engine, build_scorer, choose_engine
from posttrain.rollout.hf import HFEngine, eos_token_ids, ignored_checkpoint_sampling
from posttrain.rollout.lean import LeanEngine

__all__ = [
    "HFEngine",
    "LeanEngine",
    "Rollout",
    "RolloutConfig",
    "RolloutEngine",
    "SamplingParams",
    "ScoringConfig",
    "TokenScorer",
    "build_engine",
    "build_scorer",
    "choose_engine",
    "concat_rollouts",
    "eos_token_ids",
    "ignored_checkpoint_sampling",
    "left_pad",
    "response_mask_from_ends",
    "scored_logprobs",
]

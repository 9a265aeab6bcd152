"""posttrain.models: the four RLHF roles (policy, reference, reward, critic) on Hugging Face models."""

from posttrain.models.loading import (
    ModelConfig,
    disable_dropout,
    is_peft_adapter,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
)
from posttrain.models.roles import (
    CRITIC_INITS,
    PolicyWithValueHead,
    Reference,
    RewardScorer,
    ValueModel,
    adapter_base,
    is_peft_model,
    load_critic,
    load_policy,
    load_reward_model,
    response_logprobs,
    sequence_logprobs,
    sequence_scores,
    token_values,
)

__all__ = [
    "CRITIC_INITS",
    "ModelConfig",
    "PolicyWithValueHead",
    "Reference",
    "RewardScorer",
    "ValueModel",
    "adapter_base",
    "disable_dropout",
    "is_peft_adapter",
    "is_peft_model",
    "load_causal_lm",
    "load_critic",
    "load_policy",
    "load_reward_model",
    "load_scalar_model",
    "load_tokenizer",
    "response_logprobs",
    "sequence_logprobs",
    "sequence_scores",
    "token_values",
]

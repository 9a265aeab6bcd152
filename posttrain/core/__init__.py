"""posttrain.core: the RLHF math as pure tensor functions (imports torch only).

Dimension key, used in every docstring of the repository:

    B  sequences in a batch (B = P * G for grouped sampling)
    P  prompts
    G  samples (responses) per prompt
    T  response tokens (the time axis of RL)
    V  vocabulary size
    K  responses in one human ranking

Masks are named for what a 1 means: ``mask[b, t] = 1`` means "token t of row b counts"
(a response token, not prompt, not padding, not after EOS). Values at positions where the
mask is 0 may hold anything, NaN and inf included: every function here selects with
``torch.where`` before it computes, so garbage there changes neither results nor gradients.
"""

from posttrain.core.advantages import (
    decoupled_gae,
    gae,
    group_advantages,
    length_adaptive_lam,
    rloo_advantages,
    shape_rewards,
)
from posttrain.core.distill import generalized_jsd, reverse_kl_advantages, vocab_kl
from posttrain.core.importance import (
    IMPORTANCE_LEVELS,
    masked_importance_weights,
    truncate_logits,
    truncated_importance_weights,
    truncated_logprobs,
)
from posttrain.core.kl import KL_ESTIMATORS, adaptive_kl_coef, kl_penalty
from posttrain.core.logprobs import entropy_from_logits, token_logprobs, yes_probability
from posttrain.core.losses import (
    AGGREGATION_MODES,
    DPO_KINDS,
    POLICY_LOSSES,
    aggregate_loss,
    aggregation_units,
    cispo_policy_loss,
    dpo_loss,
    gmpo_policy_loss,
    gspo_policy_loss,
    kto_loss,
    kto_reference_point,
    orpo_loss,
    policy_loss_knobs,
    ppo_policy_loss,
    ranking_loss,
    ranking_pairs,
    sapo_policy_loss,
    simpo_loss,
    value_loss,
)
from posttrain.core.masks import (
    last_valid_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    position_ids_from_mask,
    zero_masked,
)
from posttrain.core.packing import (
    SharedPrefixBatch,
    forward_cost,
    gather_at_predictors,
    pack_groups,
    pack_shared_prefix,
    packed_group_shape,
    predictor_positions,
    response_index,
    response_last_positions,
    shared_prefix_attention_mask,
    shared_prefix_token_logprobs,
)
from posttrain.core.process import (
    STEP_AGGREGATIONS,
    aggregate_step_scores,
    implicit_prm_loss,
    implicit_process_rewards,
    prm_loss,
    process_token_rewards,
    step_end_mask,
)
from posttrain.core.token_selection import (
    ENTROPY_CONTROLS,
    TokenSelection,
    clip_cov_mask,
    high_entropy_mask,
    kl_cov_mask,
    selected_policy_loss,
    token_covariance,
)

__all__ = [
    "ENTROPY_CONTROLS",
    "TokenSelection",
    "clip_cov_mask",
    "high_entropy_mask",
    "kl_cov_mask",
    "selected_policy_loss",
    "token_covariance",
    "AGGREGATION_MODES",
    "DPO_KINDS",
    "IMPORTANCE_LEVELS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "SharedPrefixBatch",
    "STEP_AGGREGATIONS",
    "aggregate_step_scores",
    "implicit_prm_loss",
    "implicit_process_rewards",
    "prm_loss",
    "process_token_rewards",
    "step_end_mask",
    "adaptive_kl_coef",
    "aggregate_loss",
    "aggregation_units",
    "cispo_policy_loss",
    "decoupled_gae",
    "dpo_loss",
    "entropy_from_logits",
    "forward_cost",
    "gather_at_predictors",
    "generalized_jsd",
    "gae",
    "group_advantages",
    "gmpo_policy_loss",
    "gspo_policy_loss",
    "kl_penalty",
    "kto_loss",
    "kto_reference_point",
    "last_valid_index",
    "length_adaptive_lam",
    "masked_importance_weights",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "orpo_loss",
    "pack_groups",
    "packed_group_shape",
    "pack_shared_prefix",
    "position_ids_from_mask",
    "policy_loss_knobs",
    "ppo_policy_loss",
    "predictor_positions",
    "ranking_loss",
    "ranking_pairs",
    "response_index",
    "response_last_positions",
    "reverse_kl_advantages",
    "rloo_advantages",
    "shape_rewards",
    "shared_prefix_attention_mask",
    "sapo_policy_loss",
    "simpo_loss",
    "shared_prefix_token_logprobs",
    "token_logprobs",
    "truncate_logits",
    "truncated_importance_weights",
    "truncated_logprobs",
    "value_loss",
    "vocab_kl",
    "yes_probability",
    "zero_masked",
]

"""A process reward model (``posttrain prm``) as a reward in PPO and GRPO: its score at the token that ends
each step of a sampled response.

    process_reward_model:
      path: runs/prm/final/process_reward
      aggregation: min        # GRPO: one process score per response, min | sum | last over its steps
      weight: 1.0

PPO adds weight·σ(z_t) to the token reward of each token t that ends a step (``core.process_token_rewards``),
beside −β·KL_t and the outcome score at the last token; GRPO adds weight·aggregate_k σ(z_k) to each
response's outcome score before the group advantages (``core.aggregate_step_scores``). A response's steps
are found in its tokens as in the PRM's training rows (``posttrain.data.steps``), with the step separator the
checkpoint names. The PRM reads the rollout's token ids as they are, so it must share the policy's tokenizer
(checked at start).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from posttrain.core import STEP_AGGREGATIONS, aggregate_step_scores, process_token_rewards, step_end_mask
from posttrain.data.steps import TokenText, last_step_open, separator_ends
from posttrain.errors import UserError
from posttrain.models import PROCESS_REWARD_KEY, load_process_reward_model, load_tokenizer, token_scores
from posttrain.models.loading import DTYPES

if TYPE_CHECKING:
    from posttrain.rollout import Rollout


@dataclass
class ProcessRewardConfig:
    """A process reward model's scores added to the outcome reward (``posttrain.rewards.process``)."""

    path: str = ""
    """A process reward model as posttrain prm writes it (RUN/final/process_reward), sharing the policy's tokenizer."""
    aggregation: str = "min"
    """GRPO: one process score per response from its step scores σ(z_k): min (a solution is as good as its worst
    step; the usual choice of PRM work), sum (grows with the number of steps) or last. PPO rewards every step at
    its own token and takes only the default."""
    weight: float = 1.0
    """Scale of the process reward added to the outcome reward (> 0)."""
    dtype: str = "auto"
    """The process reward model's weights in memory: auto (as its checkpoint stores them), float32, bfloat16 or
    float16."""

    def validate(self, name: str = "process_reward_model") -> None:
        if not self.path:
            raise ValueError(f"{name}.path is required: a process reward model (posttrain prm writes one)")
        if self.aggregation not in STEP_AGGREGATIONS:
            raise ValueError(f"{name}.aggregation must be one of {STEP_AGGREGATIONS}, got {self.aggregation!r}")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"{name}.weight must be > 0, got {self.weight}")
        if self.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")


class ProcessReward:
    """A frozen process reward model and the step separator it was trained with, scoring rollouts."""

    def __init__(self, config: ProcessRewardConfig, tokenizer, device: str):
        self.config = config
        self.model = load_process_reward_model(config.path, device, config.dtype)
        self.separator = getattr(self.model.config, PROCESS_REWARD_KEY)["step_separator"]
        if load_tokenizer(config.path).get_vocab() != tokenizer.get_vocab():
            raise UserError(
                f"process_reward_model.path={config.path}: its tokenizer is not the policy's; the process reward "
                "model reads the policy's token ids as they are, so train it from a model with the policy's tokenizer"
            )
        self.text = TokenText(tokenizer)
        self.special = set(tokenizer.all_special_tokens)  # the EOS after a last separator starts no step

    def step_ends(self, rollout: Rollout) -> torch.Tensor:
        """[B, T] bool: the response tokens that end a step (``core.step_end_mask``)."""
        separators = torch.zeros(rollout.response_ids.shape, dtype=torch.bool)
        closed = ~rollout.truncated.cpu().bool()  # cut by max_new_tokens: its last step is unfinished
        lengths = rollout.response_mask.sum(1).tolist()  # 1s up to the response's end, then 0s
        for row, (ids, n) in enumerate(zip(rollout.response_ids.cpu(), lengths, strict=True)):
            pieces = self.text(ids[: int(n)])
            separators[row, separator_ends(pieces, self.separator)] = True
            closed[row] &= last_step_open(pieces, self.separator, self.special)
        device = rollout.action_mask.device
        return step_end_mask(separators.to(device), rollout.action_mask, closed.to(device))

    def step_logits(self, rollout: Rollout, micro: int) -> torch.Tensor:
        """[B, T] the PRM's logit at each response token (read at the token itself), ``micro`` rows a forward."""
        device, T = next(self.model.parameters()).device, rollout.response_length
        out = []
        with torch.no_grad():
            for start in range(0, len(rollout), micro):
                rows = slice(start, start + micro)
                ids, mask = rollout.input_ids[rows].to(device), rollout.attention_mask[rows].to(device)
                out.append(token_scores(self.model, ids, mask)[:, -T:])
        return torch.cat(out).to(rollout.response_ids.device)

    def response_scores(self, rollout: Rollout, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """GRPO's: (aggregation of each response's step scores σ(z_k) [B] (``core.aggregate_step_scores``),
        the number of steps of each response [B])."""
        ends = self.step_ends(rollout)
        scores = aggregate_step_scores(self.step_logits(rollout, micro), ends, self.config.aggregation)
        return scores, ends.sum(1)

    def token_rewards(self, rollout: Rollout, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """PPO's: (weight·σ(z_t) at each token t that ends a step, 0 elsewhere [B, T]
        (``core.process_token_rewards``), the step ends [B, T] bool)."""
        ends = self.step_ends(rollout)
        return process_token_rewards(self.step_logits(rollout, micro), ends, self.config.weight), ends

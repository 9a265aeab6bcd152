"""Entropy control for GRPO and PPO (``entropy_control``): the step's token selection, made once per step before
the first update, over the whole batch of every process (``core.token_selection`` has the formulas).

A threshold, a top-k or a covariance's means taken per micro-batch or per process would change with
``run.micro_batch_size`` and the number of processes; here every process gathers the step's tokens, selects
on the whole batch alike (the Clip-Cov draw from a generator seeded by the run's seed and the step, so a
resumed run and every process draw the same tokens) and keeps its own rows. Docs: docs/algorithms/grpo.md
(Entropy control).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from posttrain.core import (
    ENTROPY_CONTROLS,
    TokenSelection,
    clip_cov_mask,
    high_entropy_mask,
    kl_cov_mask,
    masked_mean,
    token_covariance,
)
from posttrain.runtime.config import RunConfig, check_choice
from posttrain.runtime.update import micro_slices

KNOBS_OF = {
    "high_entropy": ("high_entropy_ratio",),
    "clip_cov": ("clip_cov_ratio", "clip_cov_low", "clip_cov_high"),
    "kl_cov": ("kl_cov_ratio", "kl_cov_coef"),
}
"""{method: the knobs of ``EntropyControlConfig`` it reads}; another knob set to a non-default value fails at start."""


@dataclass
class EntropyControlConfig:
    """Which response tokens get the policy gradient (GRPO and PPO): all, the high-entropy minority, or all but
    the few whose log-prob/advantage covariance drives the entropy down (detached, or penalised)."""

    method: str = "none"
    """none; high_entropy (only the top high_entropy_ratio of the step's tokens by entropy train; Wang et al.
    2025); clip_cov (the gradient of clip_cov_ratio of the tokens, drawn from those whose covariance lies in
    [clip_cov_low, clip_cov_high], is detached; Cui et al. 2025); kl_cov (the kl_cov_ratio of the tokens of
    largest covariance get kl_cov_coef·|log π_θ − log π_old|; Cui et al. 2025)."""
    high_entropy_ratio: float = 0.2
    """ρ of high_entropy: the share of the step's valid tokens, by the entropy of π_old, that keep their
    policy gradient (the paper's 0.2)."""
    clip_cov_ratio: float = 2e-4
    """r of clip_cov: tokens detached = max(1, ⌊r·N⌋) of the step's N valid tokens (the paper's 2e-4)."""
    clip_cov_low: float = 1.0
    """ω_low of clip_cov: the lower end of the covariance band the detached tokens are drawn from."""
    clip_cov_high: float = 5.0
    """ω_high of clip_cov: the upper end of that band."""
    kl_cov_ratio: float = 2e-3
    """k of kl_cov: tokens penalised = max(1, ⌊k·N⌋), those of largest covariance (the paper's 2e-3 for
    Qwen2.5-7B, 2e-4 for 32B)."""
    kl_cov_coef: float = 1.0
    """β of kl_cov's penalty β·|log π_θ − log π_old| on the penalised tokens (the authors' code: 1)."""

    def validate(self, name: str = "entropy_control") -> None:
        check_choice(f"{name}.method", self.method, ENTROPY_CONTROLS)
        for key in ("high_entropy_ratio", "clip_cov_ratio", "kl_cov_ratio"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"{name}.{key} must be in (0, 1], got {getattr(self, key)}")
        if self.clip_cov_low > self.clip_cov_high:
            raise ValueError(
                f"{name}.clip_cov_low must be <= clip_cov_high, got {self.clip_cov_low} > {self.clip_cov_high}"
            )
        if self.kl_cov_coef < 0:
            raise ValueError(f"{name}.kl_cov_coef must be >= 0, got {self.kl_cov_coef}")
        read = ("method", *KNOBS_OF.get(self.method, ()))
        for key, default in ((f.name, f.default) for f in fields(self) if f.name not in read):
            if getattr(self, key) != default:  # a knob set but never read fails, as reject_ignored's do
                owner = next(m for m, knobs in KNOBS_OF.items() if key in knobs)
                raise ValueError(
                    f"{name}.{key}={getattr(self, key)!r} is not used by {name}.method={self.method}: only {owner} "
                    "reads it"
                )

    def check_trainer(self, updates_per_rollout: int, knobs: str, policy_loss: str, name="entropy_control") -> None:
        """What the trainer's own knobs cannot combine with, refused at start: KL-Cov with one update per
        rollout (its penalty is 0 while π_θ = π_old), a selection with GSPO's or GMPO's one ratio per response
        (every token's log-prob gets the gradient of the response's ratio, so dropping a token's term detaches
        nothing)."""
        if self.method == "kl_cov" and updates_per_rollout == 1:
            raise ValueError(
                f"{name}.method=kl_cov with one update per rollout ({knobs}): its penalty "
                "β·|log π_θ − log π_old| and its gradient are 0 while π_θ = π_old, so it would change nothing; "
                "use more than one update per rollout"
            )
        if self.method in ("high_entropy", "clip_cov") and policy_loss in ("gspo", "gmpo"):
            raise ValueError(
                f"{name}.method={self.method} with policy_loss={policy_loss}: its one ratio per response carries "
                "every token's gradient, so a token left out still trains; use policy_loss=gspo-token, ppo or sapo"
            )

    @property
    def needs_entropy(self) -> bool:
        return self.method == "high_entropy"


def sampling_entropy(forward: Callable[[slice], torch.Tensor], num_rows: int, micro_batch_size: int) -> torch.Tensor:
    """The entropy [B, T] of π_old at every response token, before the step's first update: ``forward(rows)``
    returns the entropy [b, T] of rows ``rows``, run here in micro-batches without gradients."""
    with torch.no_grad():
        return torch.cat([forward(s) for s in micro_slices(num_rows, micro_batch_size)])


def select_tokens(
    accelerator,
    config: EntropyControlConfig,
    run: RunConfig,
    step: int,
    mask: torch.Tensor,
    entropy_of: Callable[[slice], torch.Tensor],
    logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
) -> tuple[TokenSelection | None, dict[str, float]]:
    """(this process's rows of step ``step``'s selection, its metrics) for ``config.method`` (None, {} for
    none): what GRPO's and PPO's ``select_tokens`` share, each passing its own entropy forward.

    mask: [B, T] the tokens that train; entropy_of(rows): π_old's entropy [b, T] of rows ``rows``, run without
    gradients in micro-batches of ``run.micro_batch_size`` (high_entropy only); logprobs: [B, T] π_old's and
    advantages: [B, T] (clip_cov, kl_cov; Clip-Cov's draw seeded by ``run.seed`` and ``step``). Every process
    must call it (a gather) with as many rows.
    Metrics, over every process's tokens: ``policy/selected_share`` (the share of the tokens whose policy
    gradient trains), high_entropy's ``policy/entropy_threshold`` (τ), the covariance's
    ``policy/cov_mean`` (the batch covariance of log π_old and A) and ``policy/cov_max``, clip_cov's
    ``policy/cov_band_share`` (tokens in the band), kl_cov's ``policy/penalised_share``.
    """
    if config.method == "none":
        return None, {}
    rows, length = mask.shape
    entropy = None
    if config.needs_entropy:  # the entropy alone: no log-probs or advantages to gather
        entropy, logprobs, advantages = sampling_entropy(entropy_of, rows, run.micro_batch_size), None, None
    whole = [_gathered(accelerator, t) for t in (mask.long(), entropy, logprobs, advantages)]
    n = accelerator.num_processes
    assert len(whole[0]) == n * rows, f"entropy_control: {n} processes of unequal rows ({len(whole[0])} ≠ {n}·{rows})"
    selection, values = _select(config, *whole, _draw_generator(run.seed, step))
    start = accelerator.process_index * rows  # every process holds as many rows (asserted above)
    mine = selection.rows(slice(start, start + rows))
    metrics = dict(zip(values, torch.stack([v.double() for v in values.values()]).tolist(), strict=True))
    return TokenSelection(mine.selected[:, :length], mine.penalised[:, :length]), metrics


def _select(config: EntropyControlConfig, mask, entropy, logprobs, advantages, generator):
    """(the selection of the whole batch, {metric: 0-d tensor})."""
    valid = mask.bool()
    tokens = valid.sum().clamp(min=1).double()
    none = torch.zeros_like(valid)
    values = {}
    if config.method == "high_entropy":
        selected = high_entropy_mask(entropy, valid, config.high_entropy_ratio)
        values["policy/entropy_threshold"] = torch.where(selected, entropy, torch.inf).min()
        return TokenSelection(selected, none), {"policy/selected_share": selected.sum() / tokens, **values}
    covariance = token_covariance(logprobs.float(), advantages.float(), valid)
    values["policy/cov_mean"] = masked_mean(covariance, valid)
    values["policy/cov_max"] = torch.where(valid, covariance, -torch.inf).max()
    if config.method == "clip_cov":
        low, high = config.clip_cov_low, config.clip_cov_high
        selected = clip_cov_mask(covariance, valid, config.clip_cov_ratio, low, high, generator)
        values["policy/cov_band_share"] = (valid & (covariance >= low) & (covariance <= high)).sum() / tokens
        return TokenSelection(selected, none), {"policy/selected_share": selected.sum() / tokens, **values}
    penalised = kl_cov_mask(covariance, valid, config.kl_cov_ratio)
    values["policy/penalised_share"] = penalised.sum() / tokens
    return TokenSelection(valid, penalised), {"policy/selected_share": valid.sum() / tokens, **values}


def _gathered(accelerator, values: torch.Tensor | None) -> torch.Tensor | None:
    """``values`` [B, T] of every process, [processes·B, T_max] in process order (padded on the right)."""
    if values is None:
        return None
    values = values.to(accelerator.device)
    if accelerator.num_processes == 1:
        return values
    return accelerator.gather(accelerator.pad_across_processes(values.contiguous(), dim=-1))


def _draw_generator(seed: int, step: int) -> torch.Generator:
    """Clip-Cov's draw of step ``step``: seeded from the run's seed and the step alone (not the process, not
    the minibatch order's generator), so that every process and a resumed run draw the same tokens."""
    return torch.Generator().manual_seed(zlib.crc32(f"clip_cov {seed} {step}".encode()))

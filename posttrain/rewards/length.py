"""Length rewards: DAPO's overlong soft penalty and a plain per-token penalty (composable with any reward)."""

from __future__ import annotations


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), with L_max = ``max_length``, L_cache = ``buffer``:

    0                                   if |y| ≤ L_max − L_cache
    ((L_max − L_cache) − |y|) / L_cache if L_max − L_cache < |y| ≤ L_max
    −1                                  if |y| > L_max
    """
    if buffer <= 0 or buffer > max_length:
        raise ValueError(f"overlong buffer must be in (0, max_length], got {buffer}")
    expected = max_length - buffer
    if length <= expected:
        return 0.0
    if length <= max_length:
        return (expected - length) / buffer
    return -1.0


def length_penalty(length: int, per_token: float) -> float:
    """−per_token · |y|: a plain pressure against length (a counter to a reward model's length bias)."""
    return -per_token * length


def soft_overlong(prompts, completions, max_length: int, buffer: int, **columns) -> list[float]:
    """``overlong_penalty`` as a reward function, with lengths in characters (GRPO's ``overlong_buffer_fraction``
    measures tokens instead). Compose it with any other reward: it is 0 below max_length − buffer."""
    return [overlong_penalty(len(c), max_length, buffer) for c in completions]


def per_token_length(prompts, completions, per_token: float, **columns) -> list[float]:
    """``length_penalty`` as a reward function, lengths in characters."""
    return [length_penalty(len(c), per_token) for c in completions]

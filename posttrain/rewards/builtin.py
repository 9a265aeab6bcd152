"""Reward functions that ship with posttrain, usable by name in YAML (``posttrain.rewards.builtin:...``)."""

from __future__ import annotations


def exact_answer(prompts, completions, answer, **columns) -> list[float | None]:
    """1.0 when the completion, stripped, is exactly the ``answer`` column; 0.0 otherwise; None without an answer."""
    return [None if a is None else float(c.strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


def environment_reward(prompts, completions, environment_reward, **columns) -> list[float | None]:
    """The episode's reward from its environment (``env``: the per-turn rewards summed or discounted), None
    where the environment scored none of its turns. Added to the reward functions of every run with an env."""
    return [None if r is None else float(r) for r in environment_reward]


def starts_with_answer(prompts, completions, answer, **columns) -> list[float | None]:
    """1.0 when the completion starts with the answer's digits and stops there; 0.1 for other digits; else 0.

    A shaped variant of ``exact_answer`` for character-level toy tasks (the reward of the TRL CPU
    benchmark's arithmetic task).
    """
    out = []
    for completion, a in zip(completions, answer, strict=True):
        digits = ""
        for ch in completion:
            if not ch.isdigit():
                break
            digits += ch
        out.append(1.0 if digits == str(a) else (0.1 if digits else 0.0))
    return out

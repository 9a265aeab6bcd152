"""Format rewards: does the completion follow a required structure?"""

from __future__ import annotations

import re

THINK_ANSWER = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def think_answer_format(prompts, completions, partial: bool = False, **columns) -> list[float]:
    """1.0 for ``<think>...</think><answer>...</answer>`` (DeepSeek-R1's template) and nothing else around it.

    With ``partial``, a completion that misses the full structure gets 0.25 for each of the four tags
    that appears exactly once (a gentler signal early in training).
    """
    out = []
    for completion in completions:
        if THINK_ANSWER.fullmatch(completion):
            out.append(1.0)
        elif partial:
            out.append(sum(0.25 for tag in _TAGS if completion.count(tag) == 1))
        else:
            out.append(0.0)
    return out


def regex_format(prompts, completions, pattern: str, **columns) -> list[float]:
    """1.0 when the whole completion matches ``pattern`` (Python regex, DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(bool(compiled.fullmatch(c))) for c in completions]

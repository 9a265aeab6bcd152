"""Verifiable math rewards: extract the final answer, compare it with the reference.

Extraction, in order: the last ``\\boxed{...}``; GSM8K's ``#### 42``; "the answer is ..."; the last
number in the text. Comparison uses Hugging Face's ``math-verify`` (LaTeX, fractions, percentages,
equations such as ``x=3`` against ``3``) when installed (``posttrain[math]``), and otherwise — or when
math-verify parses nothing — a plain numeric comparison: both sides as numbers after removing ``,``,
``$`` and a trailing ``%`` (which divides by 100), equal within a relative 1e-6.
"""

from __future__ import annotations

import logging
import math
import re

# posttrain puts its own timeout around every reward call; math-verify's note that its own is off is noise
logging.getLogger("math_verify").setLevel(logging.ERROR)

_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*\$?([^\n$]+?)\$?\s*(?:\.\s*$|\.\s|$)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?%?|-?\.\d+%?")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer written in ``text``, or None when there is none."""
    boxed = last_boxed(text)
    if boxed:
        return boxed
    marker = text.rfind("####")
    if marker >= 0 and text[marker + 4 :].strip():
        return text[marker + 4 :].strip().splitlines()[0].strip()
    said = _ANSWER_IS.findall(text)
    if said:
        return said[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> float | None:
    cleaned = text.strip().strip("$").replace(",", "").replace("\\%", "%").rstrip(".")
    scale = 1.0
    if cleaned.endswith("%"):
        cleaned, scale = cleaned[:-1], 0.01
    try:
        return float(cleaned) * scale
    except ValueError:
        match = _NUMBER.findall(cleaned)
        if len(match) == 1 and match[0] != cleaned:
            return _as_number(match[0])
        return None


def numbers_match(pred: str, gold: str) -> bool:
    """The documented fallback: both parse as numbers and agree within a relative 1e-6."""
    a, b = _as_number(pred), _as_number(gold)
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def _latex(text: str) -> str:
    text = text.strip()
    return text if text.startswith("$") else f"${text}$"


def answers_match(pred: str, gold: str) -> bool:
    """Whether the extracted answer ``pred`` equals the reference ``gold``."""
    try:
        from math_verify import parse, verify
    except ImportError:  # the [math] extra is optional
        return numbers_match(pred, gold)
    # posttrain runs reward functions under its own timeout, so math-verify's signal-based ones are off
    gold_parsed = parse(_latex(gold), parsing_timeout=None)
    pred_parsed = parse(_latex(pred), parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return numbers_match(pred, gold)
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None)) or numbers_match(pred, gold)


def math_answer(prompts, completions, answer, **columns) -> list[float | None]:
    """1.0 when the completion's final answer equals the ``answer`` column, else 0.0; None without an answer."""
    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        if gold is None or str(gold).strip() == "":
            out.append(None)
            continue
        pred = extract_answer(completion)
        out.append(float(pred is not None and answers_match(pred, str(gold))))
    return out

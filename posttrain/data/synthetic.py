"""Small synthetic tasks, deterministic from a seed, for tests, the demo and the examples.

- ``arithmetic_sft``: ``{"prompt": "12+34=", "completion": "46"}`` with a verifiable ``answer`` column,
  optionally from a noisy demonstrator (some completions off by one).
- ``vowel_rankings``: K random letter strings ranked by how many vowels they hold (more is better): a
  preference a tiny reward model can learn, with a true score to check it against.
- ``vowel_pairs``: the same as preference pairs (the best and the worst of each ranking).
- ``calculator_products``: products of a 3–4-digit and a 2-digit number as calculator episodes
  (``env.name=calculator``): SFT conversations that call the tool and copy its answer, and prompt rows.
- ``arithmetic_pairs``: sums as preference pairs, the right sum chosen and one off by one rejected;
  ``unpaired`` splits pairs into KTO's unpaired rows (a desirable and an undesirable completion).
"""

from __future__ import annotations

import random
import string

VOWELS = set("aeiou")


def arithmetic_sft(n: int, seed: int = 0, low: int = 10, high: int = 49, noise: float = 0.0) -> list[dict]:
    """Sums of two numbers in [low, high]. With probability ``noise`` the demonstrated completion is
    off by one (a noisy demonstrator); the ``answer`` column always holds the true sum, so a
    verifiable reward can tell the two apart and RL can remove what SFT copied."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        shown = a + b + (1 if rng.random() < noise else 0)
        rows.append({"prompt": f"{a}+{b}=", "completion": str(shown), "answer": str(a + b)})
    return rows


def calculator_products(n: int, seed: int = 0, skip_tool: float = 0.0) -> list[dict]:
    """``{"prompt": "1234*56=", "answer": "69104", "messages": [...]}``: a product a tiny model cannot work out
    but can read off the calculator. ``messages`` demonstrates the episode (user, the ``<calc>`` call, the
    tool's answer, the answer copied); with probability ``skip_tool`` the demonstrator answers at once
    without the tool, with a guess that keeps the leading digits (so SFT copies a habit RL can remove)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(100, 9999), rng.randint(10, 99)
        prompt, answer = f"{a}*{b}=", str(a * b)
        if rng.random() < skip_tool:
            guess = answer[:2] + "".join(rng.choice(string.digits) for _ in answer[2:])
            turns = [{"role": "assistant", "content": guess}]
        else:
            turns = [
                {"role": "assistant", "content": f"<calc>{a}*{b}</calc>"},
                {"role": "tool", "content": answer},
                {"role": "assistant", "content": answer},
            ]
        rows.append({"prompt": prompt, "answer": answer, "messages": [{"role": "user", "content": prompt}, *turns]})
    return rows


def vowel_count(text: str) -> int:
    return sum(c in VOWELS for c in text)


def vowel_rankings(n: int, k: int = 4, length: int = 8, seed: int = 0) -> list[dict]:
    """Rankings of ``k`` strings with distinct vowel counts, best (most vowels) first."""
    rng = random.Random(seed)
    letters = string.ascii_lowercase
    rows = []
    while len(rows) < n:
        counts = rng.sample(range(length + 1), k)
        responses = []
        for c in sorted(counts, reverse=True):
            chars = [rng.choice("aeiou") for _ in range(c)]
            chars += [rng.choice([x for x in letters if x not in VOWELS]) for _ in range(length - c)]
            rng.shuffle(chars)
            responses.append("".join(chars))
        rows.append({"prompt": "rank:", "responses": responses})
    return rows


def vowel_pairs(n: int, length: int = 8, seed: int = 0) -> list[dict]:
    return [
        {"prompt": r["prompt"], "chosen": r["responses"][0], "rejected": r["responses"][-1]}
        for r in vowel_rankings(n, k=2, length=length, seed=seed)
    ]


def arithmetic_pairs(n: int, seed: int = 0, low: int = 10, high: int = 49) -> list[dict]:
    """Preference pairs on the sums of ``arithmetic_sft``: the right sum chosen, the sum off by one (up
    or down, at random) rejected."""
    rng = random.Random(seed)
    return [
        {"prompt": r["prompt"], "chosen": r["answer"], "rejected": str(int(r["answer"]) + rng.choice([-1, 1]))}
        for r in arithmetic_sft(n, seed=seed, low=low, high=high)
    ]


def unpaired(pairs: list[dict]) -> list[dict]:
    """Preference pairs as unpaired preference rows (KTO's format), as TRL's ``unpair_preference_dataset``
    does: each pair gives (prompt, chosen, label true) and (prompt, rejected, label false)."""
    rows = []
    for pair in pairs:
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    return rows

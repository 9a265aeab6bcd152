"""Small synthetic tasks, deterministic from a seed, for tests, the demo and the examples.

- ``arithmetic_sft``: ``{"prompt": "12+34=", "completion": "46"}`` with a verifiable ``answer`` column,
  optionally from a noisy demonstrator (some completions off by one).
- ``vowel_rankings``: K random letter strings ranked by how many vowels they hold (more is better): a
  preference a tiny reward model can learn, with a true score to check it against.
- ``vowel_pairs``: the same as preference pairs (the best and the worst of each ranking).
- ``calculator_products``: products of a 3–4-digit and a 2-digit number as calculator episodes
  (``env.name=calculator``): SFT conversations that call the tool and copy its answer, and prompt rows.
- ``vowel_counts``: ``{"prompt": "v:qazeu=", "completion": "3"}``, the number of vowels in a short string (a
  second task beside the sums: distillation from several teachers), optionally from a noisy demonstrator.
- ``arithmetic_pairs``: sums as preference pairs, the right sum chosen and one off by one rejected;
  ``unpaired`` splits pairs into KTO's unpaired rows (a desirable and an undesirable completion).
- ``stepwise_sums``: sums of a few numbers solved step by step, each step labelled (a process reward
  model's rows), some with one wrong step; ``stepwise_as_sft`` makes them SFT rows.
- ``a_strings``: ``{"prompt": "597:", "completion": "acaaaaba"}``, strings of a, b and c with a uniform number
  of a's: a model SFT'd on them gives K answers of different quality under the rule "more a's is better" (the
  hidden rule of the human-feedback loop's scripted labeller).
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


def vowel_counts(n: int, seed: int = 0, length: int = 5, noise: float = 0.0) -> list[dict]:
    """``{"prompt": "v:qazeu=", "completion": "3", "answer": "3"}``: how many vowels a random lower-case string
    of ``length`` letters holds (letters drawn half from the vowels, so every count occurs). With probability
    ``noise`` the demonstrated count is off by one, as ``arithmetic_sft``'s; ``answer`` is always the true count."""
    rng = random.Random(seed)
    consonants = [c for c in string.ascii_lowercase if c not in VOWELS]
    rows = []
    for _ in range(n):
        text = "".join(rng.choice(sorted(VOWELS) if rng.random() < 0.5 else consonants) for _ in range(length))
        count = vowel_count(text)
        shown = count + (1 if rng.random() < noise else 0)
        rows.append({"prompt": f"v:{text}=", "completion": str(shown), "answer": str(count)})
    return rows


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


def stepwise_sums(
    n: int, seed: int = 0, terms: int = 3, low: int = 0, high: int = 9, error_rate: float = 0.5, error_size: int = 1
) -> list[dict]:
    """Sums solved step by step, as step-labelled rows (TRL's stepwise supervision type) with the true sum in
    ``answer``: ``{"prompt": "3+4+2=", "completions": ["3+4=7", "7+2=9"], "labels": [true, true], "answer": "9"}``.

    With probability ``error_rate`` one step, chosen at random, writes its sum off by ``error_size`` (down or up
    at random; up where down would go below 0); the steps after it add to that wrong total correctly. A large
    ``error_size`` (10 on single-digit sums) makes a wrong step visible without arithmetic (a fast test).
    Labelled as Math-Shepherd labels (Wang et al. 2024): a step is correct
    when the right answer can still be reached from it, so the wrong step and every step after it are false."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        numbers = [rng.randint(low, high) for _ in range(terms)]
        wrong = rng.randrange(terms - 1) if rng.random() < error_rate else None
        total, steps, labels = numbers[0], [], []
        for k, b in enumerate(numbers[1:]):
            result = total + b
            if k == wrong:
                result += error_size if result < error_size or rng.random() < 0.5 else -error_size
            steps.append(f"{total}+{b}={result}")
            labels.append(wrong is None or k < wrong)
            total = result
        prompt = "+".join(map(str, numbers)) + "="
        rows.append({"prompt": prompt, "completions": steps, "labels": labels, "answer": str(sum(numbers))})
    return rows


def stepwise_as_sft(rows: list[dict], separator: str = "\n") -> list[dict]:
    """``stepwise_sums`` rows as SFT rows {prompt, completion, answer}: the steps joined by ``separator`` (a
    demonstrator whose wrong steps SFT copies), and prompt rows for GRPO / PPO keep the ``answer``."""
    return [
        {"prompt": r["prompt"], "completion": separator.join(r["completions"]), "answer": r["answer"]} for r in rows
    ]


def a_strings(n: int, seed: int = 0, length: int = 8) -> list[dict]:
    """SFT rows ``{"prompt": "<number 0-999>:", "completion": <length letters>}``: a number of a's drawn
    uniformly from 0..length, the other letters b or c, shuffled. Samples of a model trained on them differ
    in their count of a's, so a rule on that count ranks them (tests/test_feedback_loop.py)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        count = rng.randint(0, length)
        letters = ["a"] * count + [rng.choice("bc") for _ in range(length - count)]
        rng.shuffle(letters)
        rows.append({"prompt": f"{rng.randint(0, 999)}:", "completion": "".join(letters)})
    return rows

"""Shared test helpers: one assert_close with tolerances per dtype."""

from __future__ import annotations

import torch

TOLERANCES = {
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=1e-4),
}


def assert_close(actual, expected, dtype: torch.dtype | None = None, **override) -> None:
    """torch.testing.assert_close with this project's tolerance for ``dtype`` (the actual's by default)."""
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    tol = dict(TOLERANCES[dtype or actual.dtype])
    tol.update(override)
    torch.testing.assert_close(actual, expected, **tol)


def crash_at(step: int):
    """A trainer callback that kills the run (KeyboardInterrupt) when ``step`` is done."""

    def callback(done: int, metrics: dict) -> None:
        if done == step:
            raise KeyboardInterrupt

    return callback


# What an instruct checkpoint's generation_config.json may hold (Qwen-Instruct sets top_k=20 and a
# repetition penalty); none of it may change what posttrain samples.
CHECKPOINT_GENERATION_DEFAULTS = {
    "do_sample": True,
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.8,
    "min_p": 0.05,
    "typical_p": 0.9,
    "epsilon_cutoff": 0.0003,
    "repetition_penalty": 1.5,
    "no_repeat_ngram_size": 2,
    "bad_words_ids": [[10], [11]],
    "suppress_tokens": [12, 13],
    "begin_suppress_tokens": [14],
    "sequence_bias": [[[15], -5.0]],
    "renormalize_logits": True,
}


def copy_with_generation_defaults(src, dst, **fields):
    """A copy of the checkpoint at ``src`` whose generation_config.json also holds ``fields``
    (default: ``CHECKPOINT_GENERATION_DEFAULTS``). Returns ``dst`` as a string."""
    import json
    import shutil
    from pathlib import Path

    shutil.copytree(src, dst)
    path = Path(dst) / "generation_config.json"
    config = json.loads(path.read_text())
    config.update(fields or CHECKPOINT_GENERATION_DEFAULTS)
    path.write_text(json.dumps(config))
    return str(dst)

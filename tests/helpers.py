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

"""One sampled batch of prompts, as the online trainers and the asynchronous producer both draw it: what
``runtime/online.py`` shares with ``runtime/producer.py`` lives here, below both, so neither imports the other."""

from __future__ import annotations

from posttrain.data import PromptExample
from posttrain.rollout import RolloutEngine, SamplingParams


def sample(engine: RolloutEngine, policy, prompts: list[PromptExample], params: SamplingParams, n: int):
    """A rollout of ``n`` samples per prompt from ``policy`` (the unwrapped trained module), and each
    reward column repeated to match its rows."""
    with engine.generating(policy):
        rollout = engine.generate([p.prompt_ids for p in prompts], params, n=n)
    keys = sorted({k for p in prompts for k in p.columns})
    columns = {k: [p.columns.get(k) for p in prompts for _ in range(n)] for k in keys}
    rollout.columns = columns
    return rollout, columns

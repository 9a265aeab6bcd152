"""Reward models as reward functions, alone or as an ensemble.

    rewards:
      - function: posttrain.rewards.model:reward_model
        kwargs: {path: runs/rm/final/reward}
      - function: posttrain.rewards.model:reward_ensemble
        kwargs: {paths: [rm_a, rm_b, rm_c], combine: mean_minus_std, k: 1.0}

Each model is loaded once per process (cached by path) and scores ``prompt + completion`` texts in
batches with its own tokenizer, read at the last token (``posttrain.models.sequence_scores``). An
ensemble vetoes one model's blind spot with the others: ``min``, ``mean``, or ``mean − k·std``
(a conservative, uncertainty-penalised reward; Coste et al. 2024).
"""

from __future__ import annotations

import functools

import torch

ENSEMBLE_COMBINES = ("mean", "min", "mean_minus_std")


@functools.lru_cache(maxsize=8)
def _load(path: str, device: str):
    from posttrain.models import ModelConfig, load_reward_model, load_tokenizer

    return load_reward_model(ModelConfig(path=path, device=device)), load_tokenizer(path)


def score_texts(path: str, texts: list[str], batch_size: int = 16, device: str = "cpu") -> torch.Tensor:
    """Scores [N] of ``texts`` under the reward model at ``path``."""
    from posttrain.models import sequence_scores

    model, tokenizer = _load(path, device)
    scores = []
    for i in range(0, len(texts), batch_size):
        encoded = tokenizer(texts[i : i + batch_size], padding=True, return_tensors="pt")
        with torch.no_grad():
            scores.append(sequence_scores(model, encoded["input_ids"].to(device), encoded["attention_mask"].to(device)))
    return torch.cat(scores).cpu()


def reward_model(prompts, completions, path: str, batch_size: int = 16, device: str = "cpu", **columns) -> list[float]:
    """The score of ``prompt + completion`` under one reward model."""
    texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    return score_texts(path, texts, batch_size, device).tolist()


def combine_scores(scores: torch.Tensor, combine: str = "mean", k: float = 1.0) -> torch.Tensor:
    """[M, N] scores of M models → [N]: mean, min, or mean − k·std (std over the models, unbiased)."""
    if combine == "mean":
        return scores.mean(0)
    if combine == "min":
        return scores.amin(0)
    if combine == "mean_minus_std":
        return scores.mean(0) - k * scores.std(0)
    raise ValueError(f"ensemble combine must be one of {ENSEMBLE_COMBINES}, got {combine!r}")


def reward_ensemble(
    prompts,
    completions,
    paths: list[str],
    combine: str = "mean",
    k: float = 1.0,
    batch_size: int = 16,
    device: str = "cpu",
    **columns,
) -> list[float]:
    """Several reward models on the same completions, combined by ``combine``."""
    texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    scores = torch.stack([score_texts(path, texts, batch_size, device) for path in paths])
    return combine_scores(scores, combine, k).tolist()

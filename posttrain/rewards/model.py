"""Reward models as reward functions, alone or as an ensemble.

    rewards:
      - function: posttrain.rewards.model:reward_model
        kwargs: {path: runs/rm/final/reward}
      - function: posttrain.rewards.model:reward_ensemble
        kwargs: {paths: [rm_a, rm_b, rm_c], combine: mean_minus_std, k: 1.0}

Each model is loaded once per process (cached by path) and scores samples in batches, read at the
last token (``posttrain.models.sequence_scores``). A reward model must read the tokens it was trained
on: the chat template and the EOS the rollout ended with, which the decoded texts have lost. So in
GRPO/PPO (which hand the rollout's ``prompt_ids`` / ``completion_ids`` and the ``policy_tokenizer``)

- when the reward model's tokenizer is the policy's (same vocabulary), it scores the rollout's token
  ids as they are, exactly as PPO's ``reward_model`` does;
- otherwise the ids are decoded with every special token kept (template, EOS) and re-tokenised by the
  reward model's tokenizer, its own BOS/EOS standing in for the policy's.

Both functions run inline, in the trainer process: ``isolation`` unset means inline for them, and
``process`` is refused (``posttrain.rewards.base.MODEL_FUNCTIONS`` says why).

Called with texts alone, it scores ``prompt + completion`` as given (pass them rendered, with EOS).
An ensemble vetoes one model's blind spot with the others: ``min``, ``mean``, or ``mean − k·std``
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


def score_ids(path: str, sequences: list[list[int]], batch_size: int = 16, device: str = "cpu") -> torch.Tensor:
    """Scores [N] of token-id ``sequences`` (in the reward model's vocabulary) under the model at ``path``."""
    from posttrain.models import sequence_scores

    model, tokenizer = _load(path, device)
    scores = []
    for i in range(0, len(sequences), batch_size):
        batch = tokenizer.pad({"input_ids": sequences[i : i + batch_size]}, return_tensors="pt")
        with torch.no_grad():
            scores.append(sequence_scores(model, batch["input_ids"].to(device), batch["attention_mask"].to(device)))
    return torch.cat(scores).cpu()


def score_texts(path: str, texts: list[str], batch_size: int = 16, device: str = "cpu") -> torch.Tensor:
    """Scores [N] of ``texts`` under the reward model at ``path`` (tokenised as given)."""
    _, tokenizer = _load(path, device)
    return score_ids(path, [tokenizer(text).input_ids for text in texts], batch_size, device)


@functools.lru_cache(maxsize=8)
def _same_vocabulary(path: str, device: str, policy_tokenizer) -> bool:
    return _load(path, device)[1].get_vocab() == policy_tokenizer.get_vocab()


def rerender(prompt_ids: list[int], completion_ids: list[int], policy_tokenizer, tokenizer) -> list[int]:
    """The policy's tokens as ``tokenizer``'s: decoded with the template and EOS kept, the policy's BOS and
    final EOS swapped for ``tokenizer``'s own, re-tokenised."""
    ids = prompt_ids + completion_ids
    head, tail = [], []
    if ids and ids[0] == policy_tokenizer.bos_token_id and tokenizer.bos_token_id is not None:
        ids, head = ids[1:], [tokenizer.bos_token_id]
    if ids and ids[-1] == policy_tokenizer.eos_token_id:
        ids, tail = ids[:-1], [tokenizer.eos_token_id]
    text = policy_tokenizer.decode(ids, skip_special_tokens=False)
    return head + tokenizer(text, add_special_tokens=False).input_ids + tail


def sample_ids(path, prompts, completions, prompt_ids, completion_ids, policy_tokenizer, device) -> list[list[int]]:
    """What the reward model at ``path`` reads for each sample (see the module docstring)."""
    _, tokenizer = _load(path, device)
    if prompt_ids is None or completion_ids is None or policy_tokenizer is None:
        return [tokenizer(p + c).input_ids for p, c in zip(prompts, completions, strict=True)]
    pairs = zip(prompt_ids, completion_ids, strict=True)
    if _same_vocabulary(path, device, policy_tokenizer):
        return [p + c for p, c in pairs]
    return [rerender(p, c, policy_tokenizer, tokenizer) for p, c in pairs]


def reward_model(
    prompts,
    completions,
    path: str,
    batch_size: int = 16,
    device: str = "cpu",
    prompt_ids: list[list[int]] | None = None,
    completion_ids: list[list[int]] | None = None,
    policy_tokenizer=None,
    **columns,
) -> list[float]:
    """The score of each sample under one reward model."""
    sequences = sample_ids(path, prompts, completions, prompt_ids, completion_ids, policy_tokenizer, device)
    return score_ids(path, sequences, batch_size, device).tolist()


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
    prompt_ids: list[list[int]] | None = None,
    completion_ids: list[list[int]] | None = None,
    policy_tokenizer=None,
    **columns,
) -> list[float]:
    """Several reward models on the same samples, combined by ``combine``."""
    scores = torch.stack(
        [
            score_ids(
                path,
                sample_ids(path, prompts, completions, prompt_ids, completion_ids, policy_tokenizer, device),
                batch_size,
                device,
            )
            for path in paths
        ]
    )
    return combine_scores(scores, combine, k).tolist()

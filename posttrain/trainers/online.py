"""Plumbing shared by the online trainers (PPO, GRPO): prompt order, rollout, reference log-probs,
global statistics across processes, minibatch/micro-batch iteration, phase timers and response metrics.

The algorithms themselves (what is computed from a rollout and in which order) stay in ``ppo.py`` and
``grpo.py``, where they read like the papers' algorithm boxes.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from posttrain.core import masked_whiten, truncated_importance_weights
from posttrain.data import PromptExample
from posttrain.models import Reference, response_logprobs
from posttrain.rollout import Rollout, RolloutConfig, RolloutEngine, SamplingParams


@dataclass
class PromptSampler:
    """Prompts in seeded per-epoch permutations, read through a cursor that survives checkpoints.

    The cursor (prompts read so far) is part of the trainer state, so a resumed run reads the same
    prompts even when dynamic sampling draws a varying number of them per step.
    """

    num_prompts: int
    seed: int
    cursor: int = 0

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            epoch, k = divmod(self.cursor, self.num_prompts)
            order = torch.randperm(self.num_prompts, generator=torch.Generator().manual_seed(self.seed + epoch))
            out.append(int(order[k]))
            self.cursor += 1
        return out

    def take_for_process(self, k: int, prompts: list, accelerator) -> list:
        """This process's k prompts of the next k × processes: every process advances the cursor alike."""
        indices = self.take(k * accelerator.num_processes)
        mine = indices[accelerator.process_index * k : (accelerator.process_index + 1) * k]
        return [prompts[i] for i in mine]


class PhaseTimer:
    """Wall time per phase of a step (generate, old_logprobs, reference, reward, values, train), summed
    until read."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def read(self, step_seconds: float) -> dict[str, float]:
        """time/<phase> of the phases that ran, time/other = the rest of the step (advantages, metrics,
        host transfers), and time/step: the parts add up to the step."""
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out["time/other"] = step_seconds - sum(self.seconds.values())
        out["time/step"] = step_seconds
        self.seconds.clear()
        return out


def sample(engine: RolloutEngine, policy, prompts: list[PromptExample], params: SamplingParams, n: int):
    """A rollout of ``n`` samples per prompt from ``policy`` (the unwrapped trained module), and each
    reward column repeated to match its rows."""
    with engine.generating(policy):
        rollout = engine.generate([p.prompt_ids for p in prompts], params, n=n)
    keys = sorted({k for p in prompts for k in p.columns})
    columns = {k: [p.columns.get(k) for p in prompts for _ in range(n)] for k in keys}
    return rollout, columns


def write_samples(accelerator, output_dir, step: int, rollout: Rollout, scores: torch.Tensor, n: int) -> None:
    """Append the first ``n`` (prompt, completion, score) of this step to ``samples.jsonl``: the text the
    numbers are about, to read next to metrics.jsonl (main process only)."""
    if n <= 0 or not accelerator.is_main_process:
        return
    import json
    from pathlib import Path

    with open(Path(output_dir) / "samples.jsonl", "a", encoding="utf-8") as f:
        for i in range(min(n, len(rollout))):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "prompt": rollout.prompts[i],
                        "completion": rollout.responses[i],
                        "score": float(scores[i]),
                        "truncated": bool(rollout.truncated[i]),
                    }
                )
                + "\n"
            )


def split_minibatches(order: torch.Tensor, minibatches: int) -> list[list[int]]:
    """Every row of ``order`` [B] in min(minibatches, B) consecutive minibatches whose sizes differ by at
    most one (B = 16 in 3: 6, 5, 5). No row is left out; each minibatch is one optimizer step whose loss
    is normalised by its own units, so uneven sizes weigh every row alike within a step."""
    return [part.tolist() for part in torch.tensor_split(order, min(minibatches, len(order)))]


def micro_slices(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def reference_logprobs(reference: Reference, rollout: Rollout, micro_batch_size: int, device) -> torch.Tensor:
    """log π_ref of the response tokens, [B, T], in micro-batches (no grad)."""
    ids, mask = rollout.input_ids.to(device), rollout.attention_mask.to(device)
    parts = [
        reference.logprobs(ids[s], mask[s], rollout.response_length, rollout.temperature)
        for s in micro_slices(len(rollout), micro_batch_size)
    ]
    return torch.cat(parts)


def policy_logprobs(model, rollout: Rollout, rows: slice, device, with_entropy: bool = False, entropy_grad=False):
    """Training forward of the policy on ``rows`` of the rollout at the sampling temperature."""
    return response_logprobs(
        model,
        rollout.input_ids[rows].to(device),
        rollout.attention_mask[rows].to(device),
        rollout.response_length,
        temperature=rollout.temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )


def old_logprobs_of(
    accelerator, engine: RolloutEngine, rollout: Rollout, forward, micro_batch_size: int, config: RolloutConfig
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """(old_logprobs [B, T], importance weights [B, T] or None, metrics) of a fresh rollout.

    An engine whose log-probs are the training forward's (HF) gives the old log-probs itself. Any other
    (vLLM: its own kernels and sampler) gets one no-grad training forward, ``forward(rollout, rows)``,
    at the sampling temperature (PITFALLS #4); its own log-probs are then compared with it
    (``rollout/logprob_diff_mean|max``, mean and max |engine − training| over response tokens) and,
    when ``config.importance_sampling`` is set, turned into truncated importance weights.
    """
    if engine.logprobs_exact:
        return rollout.logprobs, None, {}
    with torch.no_grad():
        old = torch.cat([forward(rollout, s) for s in micro_slices(len(rollout), micro_batch_size)])
    if rollout.logprobs is None:
        return old, None, {}
    valid = rollout.response_mask.bool().to(old.device)
    sampler = rollout.logprobs.to(old.device)
    diff = torch.where(valid, (old - sampler).abs(), 0.0)
    tokens = max(global_sum(accelerator, valid.sum()), 1.0)
    metrics = {
        "rollout/logprob_diff_mean": global_sum(accelerator, diff.sum()) / tokens,
        "rollout/logprob_diff_max": float(accelerator.gather(diff.max()[None]).max()),
    }
    if config.importance_sampling == "none":
        return old, None, metrics
    weights = truncated_importance_weights(old, sampler, valid, config.importance_sampling, config.importance_cap)
    metrics["rollout/importance_weight_mean"] = global_sum(accelerator, torch.where(valid, weights, 0.0).sum()) / tokens
    return old, weights, metrics


def gather_whiten(accelerator, values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``core.masked_whiten`` with μ and σ over every process's rows, returned for this process's rows.

    values, mask: [B, T] (or [B] with a mask of ones). Rows of other processes are padded to one T.
    In float64: the variance of float32 rewards of 1e20 or more overflows float32 (issue 10, item 1).
    """
    dtype, values = values.dtype, values.double()
    if accelerator.num_processes == 1:
        return masked_whiten(values, mask, shift_mean).to(dtype)
    local_rows = values.shape[0]
    padded_values = accelerator.pad_across_processes(values, dim=-1)
    padded_mask = accelerator.pad_across_processes(mask, dim=-1)
    all_values, all_mask = accelerator.gather(padded_values), accelerator.gather(padded_mask)
    whitened = masked_whiten(all_values, all_mask, shift_mean)
    start = accelerator.process_index * local_rows  # every process holds the same number of rows
    return whitened[start : start + local_rows, : values.shape[-1]].to(dtype)


def global_sum(accelerator, value) -> float:
    tensor = torch.as_tensor(value, dtype=torch.float64, device=accelerator.device)
    return float(accelerator.reduce(tensor, reduction="sum"))


def global_min(accelerator, value: int) -> int:
    tensor = torch.tensor([value], dtype=torch.long, device=accelerator.device)
    return int(accelerator.gather(tensor).min())


def response_metrics(accelerator, rollout: Rollout) -> dict[str, float]:
    """Response length mean/min/max, share truncated and tokens generated, over all processes."""
    lengths = accelerator.gather(rollout.response_lengths.to(accelerator.device)).float()
    truncated = accelerator.gather(rollout.truncated.to(accelerator.device)).float()
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/min": float(lengths.min()),
        "response_length/max": float(lengths.max()),
        "truncated_share": float(truncated.mean()),
        "tokens_generated": float(lengths.sum()),
    }


def kl_metrics(accelerator, kl: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """KL per token (masked mean) and per sequence (mean of row sums), over all processes."""
    per_sequence = torch.where(mask.bool(), kl, 0.0).sum(-1)
    tokens = global_sum(accelerator, mask.sum())
    return {
        "kl/per_token": global_sum(accelerator, torch.where(mask.bool(), kl, 0.0).sum()) / max(tokens, 1.0),
        "kl/per_sequence": global_sum(accelerator, per_sequence.sum()) / max(global_sum(accelerator, len(kl)), 1.0),
    }


class StatsAccumulator:
    """Weighted means of detached scalars over micro-batches and processes."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.maxima: dict[str, float] = {}
        self.minima: dict[str, float] = {}

    def add(self, stats: dict[str, torch.Tensor], weight: float) -> None:
        for key, value in stats.items():
            value = float(value)
            if key.endswith("_max"):
                self.maxima[key] = max(self.maxima.get(key, -float("inf")), value)
            elif key.endswith("_min"):
                self.minima[key] = min(self.minima.get(key, float("inf")), value)
            else:
                self.sums[key] += value * weight
                self.weights[key] += weight

    def result(self, accelerator, prefix: str = "") -> dict[str, float]:
        out = {}
        for key in sorted(self.sums):
            out[prefix + key] = global_sum(accelerator, self.sums[key]) / max(
                global_sum(accelerator, self.weights[key]), 1e-12
            )
        for key, value in self.maxima.items():
            out[prefix + key] = float(accelerator.gather(torch.tensor([value], device=accelerator.device)).max())
        for key, value in self.minima.items():
            out[prefix + key] = float(accelerator.gather(torch.tensor([value], device=accelerator.device)).min())
        return out


def advantage_metrics(accelerator, advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and std of the advantages over the valid tokens of every process."""
    valid = mask.bool()
    count = max(global_sum(accelerator, valid.sum()), 1.0)
    mean = global_sum(accelerator, torch.where(valid, advantages, 0.0).sum()) / count
    mean_sq = global_sum(accelerator, torch.where(valid, advantages.square(), 0.0).sum()) / count
    return {"advantages/mean": mean, "advantages/std": max(mean_sq - mean**2, 0.0) ** 0.5}

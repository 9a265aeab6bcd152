"""Several trainers run one after another, in one torchrun process group or in one plain process: the
data-parallel test (test_ddp_roles.py) pays torchrun's start-up once for all of them.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_driver.py runs.json

runs.json: [[kind, [key=value, ...]], ...] with kind one of sft, rm, dpo, kto, grpo, ppo, online_dpo, distill.
Prints one JSON line, the number of processes each run had.

Online DPO and distillation refuse greedy decoding, and a process draws its samples from its own RNG stream
in batch order (every process seeded alike), so the rows of a batch split over two processes would meet
other random numbers than in one. Their runs sample each prompt on its own, the RNG seeded from the
prompt's token ids (``prompt_keyed_sampling``): the same responses whatever the number of processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import zlib
from pathlib import Path

import torch

from posttrain.cli import _end_distributed
from posttrain.rollout.base import concat_rollouts
from posttrain.runtime import online
from posttrain.runtime.config import load_config
from posttrain.trainers import distill, dpo, grpo, kto, online_dpo, ppo, rm, sft

TRAINERS = {
    "sft": (sft.SFTConfig, sft.train),
    "rm": (rm.RMConfig, rm.train),
    "dpo": (dpo.DPOConfig, dpo.train),
    "kto": (kto.KTOConfig, kto.train),
    "grpo": (grpo.GRPOConfig, grpo.train),
    "ppo": (ppo.PPOConfig, ppo.train),
    "online_dpo": (online_dpo.OnlineDPOConfig, online_dpo.train),
    "distill": (distill.DistillConfig, distill.train),
}
SAMPLED = {"online_dpo", "distill"}  # temperature > 0 only: prompt-keyed sampling


def character_sum(prompts, completions, **columns) -> list[float]:
    """Σ ord(c) mod 5 of the completion: any deterministic function of the text that varies between
    the greedy responses to different prompts."""
    return [float(sum(map(ord, c)) % 5) for c in completions]


def token_sum(prompts, completions, completion_ids, **columns) -> list[float]:
    """Σ token ids mod 5 of the completion's ids (an episode's: every turn and tool message), which vary between
    greedy episodes even where their last turns are alike."""
    return [float(sum(ids) % 5) for ids in completion_ids]


def character_sum_unless_tied(prompts, completions, tie, **columns) -> list[float]:
    """Σ ord(c) of the completion (two different responses rarely tie), but 0 for every response to a
    prompt whose ``tie`` column is true: its responses tie and give online DPO no pair."""
    return [0.0 if t else float(sum(map(ord, c))) for c, t in zip(completions, tie, strict=True)]


@contextlib.contextmanager
def prompt_keyed_sampling():
    """``online.sample`` one prompt at a time, the torch RNG seeded from the prompt's token ids (and put back
    after): a prompt's responses no longer depend on which rows share its batch, or its process."""
    batched = online.sample

    def sample(engine, policy, prompts, params, n):
        parts = []
        for prompt in prompts:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(repr(list(prompt.prompt_ids)).encode()))
                parts.append(batched(engine, policy, [prompt], params, n)[0])
        rollout = concat_rollouts(parts, engine.tokenizer.pad_token_id)  # the columns joined too
        return rollout, rollout.columns

    online.sample = sample
    try:
        yield
    finally:
        online.sample = batched


def run(runs: list) -> list[int]:
    processes = []
    for kind, overrides in runs:
        config_class, train = TRAINERS[kind]
        with prompt_keyed_sampling() if kind in SAMPLED else contextlib.nullcontext():
            processes.append(train(load_config(config_class, None, overrides))["processes"])
    return processes


if __name__ == "__main__":
    torch.set_num_threads(1)  # two ranks share the cores
    processes = run(json.loads(Path(sys.argv[1]).read_text()))
    _end_distributed()  # as the CLI does
    if os.environ.get("RANK", "0") == "0":  # one line: two ranks printing at once can interleave
        print(json.dumps(processes), flush=True)


class ToolEveryTurn:
    """An environment that answers every turn with a tool message ("ok"), so that even a random model's
    episodes run to ``env.max_turns`` with the environment's tokens between its turns."""

    tools = None

    def __init__(self, config):
        self.config = config

    def reset(self, row):
        from posttrain.envs import prompt_messages

        return prompt_messages(row)

    def step(self, state, turn):
        from posttrain.envs import StepResult

        return StepResult(messages=[{"role": "tool", "content": "ok"}], tool_calls=1)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def hang() -> str:
    """Never return (a tool that hangs)."""
    import time

    time.sleep(600)
    return ""


def explode(why: str) -> str:
    """Raise a RuntimeError.

    Args:
        why: Its message.
    """
    raise RuntimeError(why)

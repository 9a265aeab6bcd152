"""Several trainers run one after another, in one torchrun process group or in one plain process: the
data-parallel test (test_ddp_roles.py) pays torchrun's start-up once for all of them.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_driver.py runs.json

runs.json: [[kind, [key=value, ...]], ...] with kind one of sft, rm, dpo, grpo, ppo. Prints one JSON line,
the number of processes each run had.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from posttrain.cli import _end_distributed
from posttrain.trainers import dpo, grpo, ppo, rm, sft
from posttrain.trainers.config import load_config

TRAINERS = {
    "sft": (sft.SFTConfig, sft.train),
    "rm": (rm.RMConfig, rm.train),
    "dpo": (dpo.DPOConfig, dpo.train),
    "grpo": (grpo.GRPOConfig, grpo.train),
    "ppo": (ppo.PPOConfig, ppo.train),
}


def character_sum(prompts, completions, **columns) -> list[float]:
    """Σ ord(c) mod 5 of the completion: any deterministic function of the text that varies between
    the greedy responses to different prompts."""
    return [float(sum(map(ord, c)) % 5) for c in completions]


def run(runs: list) -> list[int]:
    processes = []
    for kind, overrides in runs:
        config_class, train = TRAINERS[kind]
        processes.append(train(load_config(config_class, None, overrides))["processes"])
    return processes


if __name__ == "__main__":
    torch.set_num_threads(1)  # two ranks share the cores
    processes = run(json.loads(Path(sys.argv[1]).read_text()))
    _end_distributed()  # as the CLI does
    if os.environ.get("RANK", "0") == "0":  # one line: two ranks printing at once can interleave
        print(json.dumps(processes), flush=True)

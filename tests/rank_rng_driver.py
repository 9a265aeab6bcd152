"""A GRPO run under torchrun whose processes are all given the same prompt: each writes the responses it
sampled to ``responses_<rank>.json`` in the run's output folder (test_ddp_rng.py compares them).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/rank_rng_driver.py key=value ...
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from posttrain.cli import _end_distributed
from posttrain.runtime import online
from posttrain.runtime.config import load_config
from posttrain.trainers import grpo

if __name__ == "__main__":
    torch.set_num_threads(1)
    config = load_config(grpo.GRPOConfig, None, sys.argv[1:])
    sampled: list[str] = []
    batched = online.sample

    def recording_sample(engine, policy, prompts, params, n):
        rollout, columns = batched(engine, policy, prompts, params, n)
        sampled.extend(rollout.responses)
        return rollout, columns

    online.sample = recording_sample
    grpo.train(config)
    rank = os.environ.get("RANK", "0")
    (Path(config.run.output_dir) / f"responses_{rank}.json").write_text(json.dumps(sampled))
    _end_distributed()

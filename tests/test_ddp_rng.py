"""Sampling under data parallelism: every process draws from its own random stream (hf / lean engines;
vLLM seeds its engine with seed + rank). Every process is seeded alike at start, for identical weights;
before the first step each is reseeded with run.seed + process index, or two processes given one prompt
would sample the same responses and a group would be worth half its size."""

import json
import subprocess
import sys
from pathlib import Path

DRIVER = Path(__file__).parent / "rank_rng_driver.py"


def test_two_processes_given_one_prompt_sample_different_responses(tiny_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": "1+1="}) + "\n" for _ in range(8)))
    out = tmp_path / "run"
    overrides = [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={data}",
        "data.chat_template=never",
        f"run.output_dir={out}",
        "run.max_steps=1",
        "run.batch_size=4",  # 2 prompts of 2 samples: one prompt per process, the same text on both
        "run.progress=false",
        "run.report_to=[jsonl]",
        "num_generations=2",
        "kl_coef=0",
        "sampling.temperature=1",
        "sampling.max_new_tokens=12",
        f"rewards=[{{function: '{Path(__file__).parent / 'ddp_driver.py'}:character_sum'}}]",
        "eval.at_start=false",
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(DRIVER)]
    done = subprocess.run(torchrun + overrides, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    first, second = (json.loads((out / f"responses_{r}.json").read_text()) for r in (0, 1))
    assert len(first) == len(second) == 2
    assert first != second, "both processes drew the same responses to the same prompt: one RNG stream"

"""Sharded training through accelerate on CPU (issue 12): FSDP2 with gloo, where accelerate runs it.

accelerate 1.15 enables FSDP only for GPU-type devices: the test asks accelerate what an FSDP2
request on CPU becomes and skips, saying so, when it is not FSDP; ``bench/gpu_check.sh`` covers
FSDP2 and DeepSpeed on GPUs (docs/scaling.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

PROBE = """
import os
os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
from accelerate import Accelerator
print(Accelerator(cpu=True).distributed_type)
"""


def _fsdp_on_cpu() -> str:
    """What accelerate makes of an FSDP2 request on CPU (a fresh process: accelerate's state is global)."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def _sft(tiny_dir, tmp_path, name, launcher, env=None):
    rows = [{"prompt": f"{i}+{i}=", "completion": "x" * (1 + i % 5)} for i in range(32)]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={data}",
        "data.chat_template=never",
        "run.max_steps=2",
        "run.batch_size=8",
        "run.micro_batch_size=4",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "optim.lr=1e-3",
        f"run.output_dir={tmp_path / name}",
    ]
    out = subprocess.run(
        [*launcher, "-m", "posttrain.cli", "sft", *args], capture_output=True, text=True, timeout=900, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return load_file(str(tmp_path / name / "final" / "policy" / "model.safetensors"))


def test_fsdp2_with_two_gloo_processes_matches_one_process(tiny_dir, tmp_path):
    kind = _fsdp_on_cpu()
    if kind != "DistributedType.FSDP":
        pytest.skip(f"accelerate runs FSDP on GPU-type devices only: an FSDP2 request on CPU gives {kind}")
    one = _sft(tiny_dir, tmp_path, "one", [sys.executable])
    env = {**os.environ, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    two = _sft(tiny_dir, tmp_path, "two", torchrun, env)
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=1e-5, rtol=0)

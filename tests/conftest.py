import json
import os
import sys
from pathlib import Path

# Nothing in the test suite may reach the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).parent))


import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Tiny checkpoints built once per session: policy (llama), reward and value models, a qwen2 policy."""
    from transformers.utils import logging

    from posttrain.models.tiny import build_tiny

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("tiny")
    build_tiny(root / "policy", kind="causal", seed=0)
    build_tiny(root / "reward", kind="reward", seed=0)
    build_tiny(root / "qwen2", kind="causal", arch="qwen2", seed=1)
    return root


@pytest.fixture
def policy_config(tiny_dir):
    from posttrain.models import ModelConfig

    return ModelConfig(path=str(tiny_dir / "policy"), device="cpu")


@pytest.fixture
def tokenizer(tiny_dir):
    from posttrain.models import load_tokenizer

    return load_tokenizer(str(tiny_dir / "policy"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="session")
def noisy_sft(tiny_dir, tmp_path_factory):
    """A tiny model SFT'd on single-digit sums from a demonstrator that is off by one half the time:
    about half of its samples are right, and a verifiable reward can tell which."""
    from posttrain.data.synthetic import arithmetic_sft
    from posttrain.runtime.config import load_config
    from posttrain.trainers import sft

    root = tmp_path_factory.mktemp("noisy_sft")
    data = write_jsonl(root / "sft.jsonl", arithmetic_sft(2000, seed=0, low=0, high=9, noise=0.5))
    prompts = [{"prompt": r["prompt"], "answer": r["answer"]} for r in arithmetic_sft(300, seed=1, low=0, high=9)]
    config = load_config(
        sft.SFTConfig,
        None,
        [
            f"model.path={tiny_dir / 'policy'}",
            f"data.path={data}",
            "data.chat_template=never",
            f"run.output_dir={root / 'sft'}",
            "run.max_steps=300",
            "run.batch_size=32",
            "optim.lr=3e-3",
            "optim.scheduler=cosine",
            "run.progress=false",
            "run.report_to=[jsonl]",
        ],
    )
    sft.train(config)
    return {"policy": str(root / "sft" / "final" / "policy"), "prompts": write_jsonl(root / "prompts.jsonl", prompts)}


# ---- the browser tests of posttrain label (tests/browser_helpers.py; importing it skips without a chromium)


@pytest.fixture(scope="module")
def browser():
    """The system's Chromium, headless, driven by Playwright: one per test module."""
    from browser_helpers import chromium

    with chromium() as launched:
        yield launched


@pytest.fixture
def page(browser):
    from browser_helpers import new_page

    with new_page(browser) as opened:
        yield opened


@pytest.fixture
def serve():
    """``serve(task, *extra)``: ``posttrain label TASK --port 0 --no-browser *extra`` in a subprocess."""
    from browser_helpers import servers

    with servers() as start:
        yield start

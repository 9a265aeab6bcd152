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

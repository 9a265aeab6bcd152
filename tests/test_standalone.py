"""The repository stands alone: its tests and examples read nothing outside the checkout (issue 15).

A development machine may hold data folders beside the checkout that a user's clone does not have;
these tests run the data-touching tests and ``examples/prepare_data.py`` from a copy of the tracked
files in an empty temporary folder, so a path that leaves the checkout fails here first.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = ("../" + "shared", "shared" + "/data")  # split so that this file does not match itself
SCANNED = ("posttrain/", "tests/", "examples/", "bench/", ".ci/")
DATA_TESTS = [
    "tests/test_data.py::test_gsm8k_loader_reads_real_answers",
    "tests/test_data.py::test_hh_rlhf_pairs_share_their_prompt",
    "tests/test_rewards.py::test_every_gsm8k_solution_scores_one_and_a_shuffled_answer_scores_zero",
]


def _checkout_files() -> list[str]:
    """Tracked files plus new ones git would commit (what a clone of the next commit holds)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    return [f for f in out.stdout.decode().split("\0") if f and (ROOT / f).is_file()]


def test_no_file_refers_to_a_folder_beside_the_checkout():
    hits = []
    for name in _checkout_files():
        if name.endswith((".gz", ".parquet", ".safetensors")):
            continue
        if name.startswith(SCANNED) or name in ("Makefile", "README.md"):
            text = (ROOT / name).read_text(encoding="utf-8")
            hits += [f"{name}: {needle}" for needle in OUTSIDE if needle in text]
    assert hits == []


@pytest.mark.slow  # `make test-slow`: outside `make test`, which holds to 15 minutes
def test_data_tests_and_prepare_data_run_from_a_bare_copy(tmp_path):
    copy = tmp_path / "clone"
    for name in _checkout_files():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, copy / name)
    env = {**os.environ, "PYTHONPATH": str(copy), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    where = subprocess.run(
        [sys.executable, "-c", "import posttrain; print(posttrain.__file__)"], cwd=copy, env=env, capture_output=True
    )
    assert where.stdout.decode().startswith(str(copy))  # the copy's package, not the development checkout
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *DATA_TESTS],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert "3 passed" in tests.stdout
    prepared = subprocess.run(
        [sys.executable, "examples/prepare_data.py", "runs"], cwd=copy, env=env, capture_output=True, text=True
    )
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    for name in ("hh_rlhf", "gsm8k_test_prompts", "gsm8k_train_prompts"):
        assert (copy / "runs" / "data" / f"{name}.jsonl").stat().st_size > 0

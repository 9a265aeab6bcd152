"""Rewards: math answers on real GSM8K, format, the code sandbox against hostile programs, length,
reward-model ensembles, and faults (hangs and exceptions) in reward functions."""

import math
import os
import random
import time

import pytest
import torch

from posttrain.data import load_gsm8k
from posttrain.rewards import RewardComposer, RewardError, RewardSpec, overlong_penalty, sandbox
from posttrain.rewards.code import check_code, code_tests, extract_code
from posttrain.rewards.format import regex_format, think_answer_format
from posttrain.rewards.length import length_penalty, per_token_length, soft_overlong
from posttrain.rewards.math import answers_match, extract_answer, math_answer, numbers_match
from posttrain.rewards.model import combine_scores, reward_ensemble, reward_model
from posttrain.rewards.sandbox import IS_ROOT, isolation_level, run_program


def test_every_gsm8k_solution_scores_one_and_a_shuffled_answer_scores_zero():
    rows = load_gsm8k("test")
    solutions, answers = [r["solution"] for r in rows], [r["answer"] for r in rows]
    assert math_answer(None, solutions, answers) == [1.0] * len(rows)
    rng = random.Random(0)
    shift = [(i + rng.randint(1, len(rows) - 1)) % len(rows) for i in range(len(rows))]  # never itself
    shuffled = [answers[j] for j in shift]
    scores = math_answer(None, solutions, shuffled)
    same = [float(numbers_match(a, b)) for a, b in zip(answers, shuffled, strict=True)]  # 5 vs 5.0 happens
    assert scores == same and sum(scores) < 0.05 * len(rows)


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("so x = \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("The answer is $\\frac{1}{2}$.", "0.5", 1.0),
        ("The answer is 50%", "0.5", 1.0),  # a percentage is a number over 100
        ("#### 50%", "50", 1.0),  # math-verify accepts both readings of a percentage (GSM8K writes "50" for 50%)
        ("solving gives x=3", "3", 1.0),
        ("\\boxed{x=3}", "3", 1.0),
        ("she has 1,234 apples\n#### 1,234", "1234", 1.0),
        ("first 12 then 13", "13", 1.0),  # the last number
        ("\\boxed{\\frac{2}{4}}", "0.5", 1.0),
        ("\\boxed{7}", "8", 0.0),
        ("no number here", "8", 0.0),
    ],
)
def test_math_answer_equivalences(completion, gold, expected):
    assert math_answer(None, [completion], [gold]) == [expected]


def test_math_extraction_order_and_fallback(monkeypatch):
    assert extract_answer("a \\boxed{1} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"  # the last box, braces balanced
    assert extract_answer("work\n#### 42") == "42"
    assert extract_answer("So the answer is 17.") == "17"
    assert extract_answer("nothing") is None
    assert math_answer(None, ["4"], [None]) == [None]  # no reference: not applicable
    import builtins

    real_import = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name == "math_verify":
            raise ImportError
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)  # the documented numeric fallback
    assert (
        answers_match("1,000.0", "1000") and answers_match("25%", "0.25") and not answers_match("\\frac{1}{2}", "0.5")
    )


def test_format_rewards():
    good = "<think>2+2 is 4</think>\n<answer>4</answer>"
    assert think_answer_format(None, [good, "4", "<think>x</think> 4"]) == [1.0, 0.0, 0.0]
    assert think_answer_format(None, [good, "<think>x</think> 4", "<answer>4</answer>"], partial=True) == [
        1.0,
        0.5,
        0.5,
    ]
    assert regex_format(None, ["ABC-123", "abc"], pattern=r"[A-Z]+-\d+") == [1.0, 0.0]


def test_length_penalties_by_hand():
    # L_max = 10, L_cache = 4: 0 up to 6; then (6 − |y|)/4; −1 past 10
    assert [overlong_penalty(n, 10, 4) for n in (5, 6, 7, 8, 10, 11)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert length_penalty(20, 0.01) == pytest.approx(-0.2)
    assert soft_overlong(None, ["x" * 7], max_length=10, buffer=4) == [-0.25]
    assert per_token_length(None, ["abcd"], per_token=0.5) == [-2.0]
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(3, 10, 0)


# --------------------------------------------------------------------------------------------------
# The sandbox
# --------------------------------------------------------------------------------------------------

HOSTILE = {
    "infinite loop": "while True:\n    pass",
    "sleep": "import time\ntime.sleep(60)",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "memory hog": "x = bytearray(8 * 2**30)\nwhile True:\n    x += bytearray(2**30)",
    "write outside": "open({path!r}, 'w').write('pwned')\nopen({tmp!r}, 'w').write('pwned')",
    "socket": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=3).send(b'x')",
    "daemon left behind": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)",
}


def _sandbox_processes():
    """Live processes of this process's sandbox user-id block."""
    first = sandbox.lease()
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
                state = open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
                if first <= uid < first + sandbox.UID_BLOCK and state != "Z":
                    found.append(pid)
            except (OSError, StopIteration, ValueError):
                continue
    return found


@pytest.mark.parametrize("name", list(HOSTILE))
def test_sandbox_stops_or_contains_hostile_code(name, tmp_path):
    from pathlib import Path

    target = Path(__file__).parent / "written_by_sandboxed_code.txt"  # the checkout: outside any temp dir
    tmp_target = tmp_path / "outside.txt"
    code = HOSTILE[name].format(path=str(target), tmp=str(tmp_target))
    timeout = 2.0
    start = time.perf_counter()
    result = run_program(code, ["assert True"], timeout=timeout, memory_mb=256)
    elapsed = time.perf_counter() - start
    # the deadline counts from the moment the sandbox is ready: its start-up (slow on a loaded machine)
    # is not part of the program's time
    assert elapsed - result.startup < timeout + 1.0, (elapsed, result.startup)
    assert result.score == 0.0 and result.reason, result
    assert not target.exists() and not tmp_target.exists()
    namespaces = isolation_level() == "namespaces+uid"
    if name == "write outside" and IS_ROOT:
        # a read-only mount, denied to the sandbox's user, or invisible when the checkout lies under the
        # sandbox's private /tmp
        denied = ("Read-only file system", "Permission denied", "No such file or directory")
        assert any(reason in result.reason for reason in denied), result.reason
    if name == "socket" and namespaces:
        assert "Network is unreachable" in result.reason
    if namespaces:
        assert result.isolated
    if IS_ROOT:
        assert _sandbox_processes() == []  # nothing the program started is still running


def test_a_program_stopped_by_its_cpu_limit_is_a_timeout_not_a_crash():
    """The sandbox's CPU limit is set from the timeout; a program it stops ran out of its time. (The python
    environment once told a model its infinite loop was "killed by signal SIGXCPU" instead of "did not finish":
    the start-up's CPU seconds counted against the program.) Here the program lowers its own limit to reach it
    well before the 5 s timeout; and an ordinary loop under a 2 s timeout is stopped as a timeout too."""
    lowered = (
        "import resource\nused = resource.getrusage(resource.RUSAGE_SELF)\n"
        "limit = int(used.ru_utime + used.ru_stime) + 1\n"
        "resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 5))\nwhile True:\n    pass"
    )
    result = run_program(lowered, [], timeout=5)
    assert result.status == "timeout" and result.reason == "timeout after 5 s (its CPU time ran out)", result
    result = run_program("while True:\n    pass", [], timeout=2)
    assert result.status == "timeout" and result.reason.startswith("timeout after 2 s"), result


def test_sandbox_scores_share_of_tests_and_hides_secrets(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws_secret")
    code = "import os, math\nSEEN = dict(os.environ)\ndef area(r):\n    return math.pi * r * r"
    tests = [
        "assert 'HF_TOKEN' not in SEEN and 'AWS_SECRET_ACCESS_KEY' not in SEEN",
        "assert area(1) == math.pi",
        "assert area(2) == 1.0",
    ]
    result = run_program(code, tests, timeout=5)
    assert (result.passed, result.total, result.status) == (2, 3, "ok")
    assert result.score == pytest.approx(2 / 3) and result.reason.startswith("AssertionError")
    broken = run_program("def f(:\n    pass", ["assert True"])
    assert broken.score == 0.0 and broken.reason.startswith("SyntaxError")


def test_code_reward_function_runs_many_concurrently():
    completions = [f"Here:\n```python\ndef add(a, b):\n    return a + b + {i % 2}\n```" for i in range(12)]
    tests = [["assert add(1, 2) == 3", "assert add(0, 0) == 0"]] * 11 + [None]
    assert extract_code(completions[0]).startswith("def add")
    scores = code_tests(None, completions, tests, timeout=5, max_workers=4)
    assert scores == [1.0, 0.0] * 5 + [1.0, None]
    results = check_code(completions[:2], tests[:2])
    assert results[1].reason.startswith("AssertionError")


# --------------------------------------------------------------------------------------------------
# Reward models and ensembles
# --------------------------------------------------------------------------------------------------


def test_ensemble_combinations_by_hand():
    scores = torch.tensor([[1.0, 4.0], [3.0, 0.0], [2.0, 2.0]])  # 3 models × 2 completions
    assert combine_scores(scores, "mean").tolist() == [2.0, 2.0]
    assert combine_scores(scores, "min").tolist() == [1.0, 0.0]
    # std (unbiased) of (1, 3, 2) is 1; of (4, 0, 2) is 2
    assert combine_scores(scores, "mean_minus_std", k=0.5).tolist() == pytest.approx([1.5, 1.0])
    with pytest.raises(ValueError, match="combine"):
        combine_scores(scores, "max")


def test_reward_model_as_reward_function(tiny_dir, tokenizer):
    from posttrain.models import ModelConfig, load_reward_model, sequence_scores

    path = str(tiny_dir / "reward")
    prompts, completions = ["1+1=", "hello "], ["2", "world, longer text"]
    got = reward_model(prompts, completions, path=path)
    model = load_reward_model(ModelConfig(path=path))
    for p, c, value in zip(prompts, completions, got, strict=True):
        ids = torch.tensor([tokenizer(p + c).input_ids])
        assert value == pytest.approx(float(sequence_scores(model, ids, torch.ones_like(ids))[0]), abs=1e-5)
    both = reward_ensemble(prompts, completions, paths=[path, path], combine="mean_minus_std", k=1.0)
    assert both == pytest.approx(got, abs=1e-5)  # two identical models: std 0


# --------------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------------

FAULTY = """
import time


def hangs_on_x(prompts, completions, **columns):
    if any("x" in c for c in completions):
        time.sleep(3600)
    return [1.0] * len(completions)


def raises_on_x(prompts, completions, **columns):
    for c in completions:
        if "x" in c:
            raise KeyError("the reward's own bug")
    return [1.0] * len(completions)
"""


@pytest.fixture
def faulty(tmp_path):
    path = tmp_path / "faulty.py"
    path.write_text(FAULTY)
    return str(path)


def test_a_hanging_reward_is_killed_and_its_sample_marked(faulty):
    spec = RewardSpec(f"{faulty}:hangs_on_x", timeout=1.0, max_failure_rate=1.0, retry_after_timeout=True)
    composer = RewardComposer.from_specs([spec])
    start = time.perf_counter()
    out = composer(["p"] * 3, ["a", "b", "x"], {})
    assert time.perf_counter() - start < 5.0  # the batch call (1 s), then the samples one by one within 1 s
    assert out.components["hangs_on_x"] == [1.0, 1.0, None]
    assert math.isnan(out.total[2]) and out.metrics()["reward/hangs_on_x/timeouts"] == 1
    assert out.metrics()["reward/hangs_on_x/batch_timeouts"] == 1


def test_a_raising_reward_stops_with_the_offending_sample_or_is_counted(faulty):
    strict = RewardComposer.from_specs([RewardSpec(f"{faulty}:raises_on_x")])
    with pytest.raises(RewardError) as err:
        strict(["p1", "p2"], ["fine", "oops x"], {})
    assert "'oops x'" in str(err.value) and "'p2'" in str(err.value) and "KeyError" in str(err.value)

    lenient = RewardComposer.from_specs([RewardSpec(f"{faulty}:raises_on_x", on_error="skip", max_failure_rate=0.1)])
    out = lenient(["p"] * 10, ["a"] * 9 + ["x"], {})
    assert out.components["raises_on_x"] == [1.0] * 9 + [None]
    assert out.metrics()["reward/raises_on_x/failures"] == 1
    out = lenient(["p"] * 10, ["a"] * 9 + ["x"], {})  # 2 of 20: at the threshold, still going
    with pytest.raises(RewardError, match="max_failure_rate"):
        lenient(["p"] * 10, ["a"] * 8 + ["x", "x"], {})  # 4 of 30 > 10 %


def test_reward_spec_validation_names_the_field():
    with pytest.raises(ValueError, match=r"rewards\[0\].on_error must be one of"):
        RewardSpec("m:f", on_error="ignore").validate("rewards[0]")
    with pytest.raises(ValueError, match="isolation"):
        RewardSpec("m:f", isolation="docker").validate()


def test_builtin_answer_rewards():
    from posttrain.rewards.builtin import exact_answer, starts_with_answer

    assert exact_answer(None, [" 46 ", "46;", "x"], ["46", "46", None]) == [1.0, 0.0, None]
    # the TRL CPU benchmark's shaping: 1 for the right leading number, 0.1 for other digits, else 0
    assert starts_with_answer(None, ["46;12", "4", "x46", "461"], ["46"] * 4) == [1.0, 0.1, 0.0, 0.1]


def test_required_columns_are_the_parameters_without_a_default_that_posttrain_does_not_hand_over():
    """What ``check_columns`` asks of the data before anything is generated (newuser #23)."""
    from posttrain.rewards import required_columns
    from posttrain.rewards.builtin import exact_answer

    def custom(prompts, completions, answer, level=1, *, tests, prompt_ids, policy_tokenizer, **columns):
        return []

    assert required_columns(exact_answer) == ["answer"]
    assert required_columns(code_tests) == ["tests"]
    assert required_columns(custom) == ["answer", "tests"]
    assert required_columns(soft_overlong, {"max_length": 10, "buffer": 2}) == []  # bound by the spec's kwargs
    assert required_columns(reward_model, {"path": "m"}) == []
    assert required_columns(lambda prompts, completions, **columns: []) == []

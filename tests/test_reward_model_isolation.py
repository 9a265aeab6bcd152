"""Reward functions that run torch, after the trainer has run torch ops on several threads.

The bug: a reward model used as a reward function (``posttrain.rewards.model:reward_model``) under the
default ``isolation: process`` hung in its forked worker until the timeout, and the run stopped with
"... timeouts". libgomp is not fork-safe: the child inherits an OpenMP runtime whose worker threads fork
did not copy, and its first parallel op (the model load) waits at a barrier for them. Now the reward
models run inline (and refuse process), a forked worker runs torch on one thread, and the inline calls
share one long-lived thread."""

import pytest
import torch

from posttrain.rewards import RewardComposer, RewardSpec
from posttrain.rewards.model import _load, score_texts

TIMEOUT = 30.0  # seconds; every call here takes well under 1 s, a hung worker never returns
PROMPTS = ["rank:", "rank:", "hello", "1+1="]
COMPLETIONS = ["aeiou", "xyz", " world", "2"]


@pytest.fixture
def parallel_parent():
    """This process has run OpenMP parallel regions on 2 threads, as a trainer has by the time it scores
    (2 forced, so that the tests can fail on a 1-core machine too); the model cache starts empty."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    x = torch.randn(512, 512)
    (x @ x).exp().sum()  # an MKL gemm and an elementwise kernel, both above their parallel grain
    _load.cache_clear()
    yield
    torch.set_num_threads(threads)


def matmul_reward(prompts, completions, **columns):
    """A reward function of the user's own that runs torch: 512 for every sample."""
    ones = torch.ones(512, 512)
    return [float((ones @ ones).mean())] * len(completions)


def model_shaped_matmuls(prompts, completions, **columns):
    """The matmuls of a tiny transformer's forward (640 tokens, width 128, MLP 344); 1 for every sample."""
    for m, k, n in ((640, 128, 128), (640, 128, 344), (640, 344, 128), (640, 128, 100)):
        (torch.randn(m, k) @ torch.randn(k, n)).sum()
    return [1.0] * len(completions)


def large_matmul(prompts, completions, **columns):
    """A 1024² matmul (MKL buffers of some size); 1 for every sample."""
    (torch.randn(1024, 1024) @ torch.randn(1024, 1024)).sum()
    return [1.0] * len(completions)


def test_torch_runs_in_a_forked_reward_worker_after_the_trainer_ran_parallel_ops(parallel_parent):
    """Before the fix the call timed out (libgomp's barrier): every value None, the total NaN."""
    spec = RewardSpec("tests:matmul_reward", timeout=TIMEOUT)
    assert spec.effective_isolation == "process"  # a plain function keeps the default
    out = RewardComposer([("matmul_reward", matmul_reward, 1.0)], [spec])(PROMPTS, COMPLETIONS, {})
    assert out.total.tolist() == [512.0] * 4 and out.metrics()["reward/matmul_reward/timeouts"] == 0


def test_forked_workers_run_torch_after_inline_calls_ran_torch(parallel_parent):
    """An inline call used to run in a new thread that ended with the call; a worker forked for the next
    function as MKL released that thread's buffers could spin in ``mkl_serv_allocate`` forever: by call
    2 to 15 (median 8) in 9 runs of this loop with a thread per call. The inline calls now share one
    thread that does not end."""
    specs = [RewardSpec("tests:large", isolation="inline", timeout=TIMEOUT), RewardSpec("tests:shaped", timeout=10.0)]
    composer = RewardComposer([("inline", large_matmul, 1.0), ("forked", model_shaped_matmuls, 1.0)], specs)
    for _ in range(40):
        out = composer(PROMPTS, COMPLETIONS, {})
        assert out.metrics()["reward/forked/timeouts"] == 0 and out.total.tolist() == [2.0] * 4


def test_reward_models_score_inline_by_default_loaded_once(parallel_parent, tiny_dir):
    """With isolation unset, the reward models of posttrain.rewards.model run in this process: scored
    (they used to time out in a forked worker) and the model loaded once and kept."""
    path = str(tiny_dir / "reward")
    specs = [
        RewardSpec("posttrain.rewards.model:reward_model", kwargs={"path": path}, timeout=TIMEOUT),
        RewardSpec("posttrain.rewards.model:reward_ensemble", kwargs={"paths": [path, path]}, timeout=TIMEOUT),
    ]
    assert [s.isolation for s in specs] == [None, None]
    assert [s.effective_isolation for s in specs] == ["inline", "inline"]
    composer = RewardComposer.from_specs(specs)
    for _ in range(2):
        out = composer(PROMPTS, COMPLETIONS, {})
        metrics = out.metrics()
        assert metrics["reward/reward_model/timeouts"] == metrics["reward/reward_ensemble/timeouts"] == 0
    assert _load.cache_info().currsize == 1  # one model, loaded here once, used by 4 calls
    expected = score_texts(path, [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)])
    torch.testing.assert_close(out.total, 2 * expected, rtol=0, atol=1e-6)


def test_a_reward_model_refuses_process_isolation_at_start():
    """Explicit isolation: process for a reward model, or for any function on CUDA, is refused naming the
    field; retry_after_timeout (a process-only option) names it too."""
    path = {"path": "rm"}
    for function in ("posttrain.rewards.model:reward_model", "posttrain.rewards.model:reward_ensemble"):
        with pytest.raises(ValueError, match=r"rewards\[1\]\.isolation: process cannot run .*leave rewards\[1\]"):
            RewardSpec(function, kwargs=path, isolation="process").validate("rewards[1]")
        RewardSpec(function, kwargs=path).validate("rewards[1]")
        RewardSpec(function, kwargs={**path, "device": "cuda"}).validate("rewards[1]")  # inline: any device
    with pytest.raises(ValueError, match=r"rewards\[0\]\.isolation: process .* cannot use CUDA"):
        RewardSpec("my.module:scorer", kwargs={"device": "cuda:1"}).validate("rewards[0]")
    with pytest.raises(ValueError, match=r"rewards\[0\]\.retry_after_timeout needs rewards\[0\]\.isolation: process"):
        RewardSpec("posttrain.rewards.model:reward_model", retry_after_timeout=True).validate("rewards[0]")
    RewardSpec("m:f", retry_after_timeout=True).validate("rewards[0]")  # a plain function: process by default

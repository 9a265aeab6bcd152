"""Shared test helpers: one assert_close with tolerances per dtype."""

from __future__ import annotations

import torch

TOLERANCES = {
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=1e-4),
}


def assert_close(actual, expected, dtype: torch.dtype | None = None, **override) -> None:
    """torch.testing.assert_close with this project's tolerance for ``dtype`` (the actual's by default)."""
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    tol = dict(TOLERANCES[dtype or actual.dtype])
    tol.update(override)
    torch.testing.assert_close(actual, expected, **tol)


def crash_at(step: int):
    """A trainer callback that kills the run (KeyboardInterrupt) when ``step`` is done."""

    def callback(done: int, metrics: dict) -> None:
        if done == step:
            raise KeyboardInterrupt

    return callback


# What an instruct checkpoint's generation_config.json may hold (Qwen-Instruct sets top_k=20 and a
# repetition penalty); none of it may change what posttrain samples.
CHECKPOINT_GENERATION_DEFAULTS = {
    "do_sample": True,
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.8,
    "min_p": 0.05,
    "typical_p": 0.9,
    "epsilon_cutoff": 0.0003,
    "repetition_penalty": 1.5,
    "no_repeat_ngram_size": 2,
    "bad_words_ids": [[10], [11]],
    "suppress_tokens": [12, 13],
    "begin_suppress_tokens": [14],
    "sequence_bias": [[[15], -5.0]],
    "renormalize_logits": True,
}


def copy_with_generation_defaults(src, dst, **fields):
    """A copy of the checkpoint at ``src`` whose generation_config.json also holds ``fields``
    (default: ``CHECKPOINT_GENERATION_DEFAULTS``). Returns ``dst`` as a string."""
    import json
    import shutil
    from pathlib import Path

    shutil.copytree(src, dst)
    path = Path(dst) / "generation_config.json"
    config = json.loads(path.read_text())
    config.update(fields or CHECKPOINT_GENERATION_DEFAULTS)
    path.write_text(json.dumps(config))
    return str(dst)


def adam_step_bound(t: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The most |m̂_t / √v̂_t| can be at Adam's step t (bias-corrected), for any gradients: by Cauchy–Schwarz
    on m_t = (1−β1) Σ β1^(t−i) g_i against v_t = (1−β2) Σ β2^(t−i) g_i²,

        |m̂_t| / √v̂_t ≤ (1−β1)/(1−β1^t) · √((1−β2^t)/(1−β2)) · √(Σ_{k<t} (β1²/β2)^k)

    (1 at t = 1, 1.002 at t = 2, ≈ 1 for the first steps; at most 7.3 in the long run)."""
    ratio = sum((beta1**2 / beta2) ** k for k in range(t))
    return (1 - beta1) / (1 - beta1**t) * ((1 - beta2**t) / (1 - beta2)) ** 0.5 * ratio**0.5


def assert_adam_trained_alike(
    actual, expected, lr: float, updates: int, msg: str = "", atol: float = 1e-5, share: float = 1e-3
) -> None:
    """Weights trained from the same start by AdamW (weight decay 0) in two arithmetics that should agree
    (one process against two, ZeRO, FSDP2: another reduction order), compared by what the arithmetic
    guarantees, not by a tolerance one CPU happens to meet (issue 24 item 0).

    Adam divides by √v̂, so where an element's gradient is near zero (near-cancelling terms), the rounding
    of one reduction order against another can turn into a step of up to lr in either direction: one
    element of 32,768 differed by 1.24e-5 after 4 PPO updates on an AMD EPYC, against atol 1e-5. So:

    - at most ``share`` (0.1 %) of the elements may differ by more than ``atol`` (float noise through
      the rest of the update); a missing all-reduce trains on another gradient, and the sign of
      rank 0's half-batch gradient differs from the whole batch's on far more of them at the first
      update, where Adam's step is lr·sign(g);
    - no element may differ by more than 2 · lr · Σ_t adam_step_bound(t): what two Adam trajectories
      from the same weights can differ by after ``updates`` steps, whatever the gradients.

    Adam is invariant to the scale of the gradient, so weights cannot catch a wrong share of the loss:
    the callers compare the gradient norm of every step to rel 1e-5 (taken before the optimizer, after
    the all-reduce: a missing all-reduce or a wrong share changes it); that is the exact check."""
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    assert actual.shape == expected.shape, f"{msg}: shapes {actual.shape} and {expected.shape}"
    diff = (actual - expected).abs()
    bound = 2 * lr * sum(adam_step_bound(t) for t in range(1, updates + 1))
    worst = float(diff.max()) if diff.numel() else 0.0
    off = int((diff > atol).sum())
    allowed = max(1, int(share * diff.numel()))
    assert off <= allowed, f"{msg}: {off} of {diff.numel()} elements differ by more than {atol} (at most {allowed})"
    assert worst <= bound, f"{msg}: an element differs by {worst:.3g}, beyond Adam's bound {bound:.3g}"


def nan_updates_from(step: int, accumulate):
    """``posttrain.runtime.loop.accumulate_gradients`` (``accumulate``) made to give the ``step``-th update and
    every later one a NaN loss and NaN in every gradient, as a blown-up model does: the non-finite guard's
    input made deterministic. A learning rate of 1e6 NaNs the tiny model on a 2-core AMD EPYC but leaves it
    saturated and finite on a 2-core Intel Xeon (AMX), where no guard fires (issue 34)."""
    import math

    calls = 0

    def poisoned(accelerator, task, model, batches):
        nonlocal calls
        calls += 1
        totals, loss = accumulate(accelerator, task, model, batches)
        if calls < step:
            return totals, loss
        for p in model.parameters():
            if p.grad is not None:
                p.grad.fill_(math.nan)
        return totals, math.nan

    return poisoned


def dead_copy(tiny_dir, dst):
    """A copy of the tiny policy whose final norm and output weights are 0: every logit is 0 whatever the
    input, and every gradient is exactly 0 (the output layer sees a zero hidden state, the layers below a
    zero output weight): a dead model on any CPU, as lr=1e6 makes one on some."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_dir / "policy", dst)
    weights = load_file(dst / "model.safetensors")
    for key in ("model.norm.weight", "lm_head.weight"):
        weights[key] = torch.zeros_like(weights[key])
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def sft_args(tiny_dir, tmp_path, *overrides, rows=32) -> list[str]:
    """``key=value`` arguments of a short SFT run of the tiny policy on ``rows`` arithmetic rows (written once to
    ``tmp_path``) into ``tmp_path / "run"``, ``overrides`` last."""
    import json

    from posttrain.data.synthetic import arithmetic_sft

    data = tmp_path / f"sft{rows}.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_sft(rows, seed=0)))
    return [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={data}",
        f"run.output_dir={tmp_path / 'run'}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "data.chat_template=never",
        "optim.lr=1e-3",
        "run.batch_size=8",
        "run.micro_batch_size=8",
        *overrides,
    ]


def distill_args(student, prompts, out) -> list[str]:
    """The overrides of the short on-policy distillation runs (tiny student, 2 samples of 4 tokens per prompt,
    one micro-batch of 16); the caller names the teacher(s)."""
    return [
        f"model.path={student}",
        f"data.path={prompts}",
        "data.chat_template=never",
        f"run.output_dir={out}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "sampling.max_new_tokens=4",
        "num_generations=2",
        "run.batch_size=16",
        "run.micro_batch_size=16",
        "optim.lr=1e-3",
    ]


def one_line(status: int, stderr: str, command: str, message: str) -> None:
    """Exit 2 and exactly one line on stderr, ``posttrain <command>: error: ...`` holding ``message``."""
    assert status == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith(f"posttrain {command}: error: "), lines[0]
    assert message in lines[0], lines[0]


def signal_when(proc, ready, what: str, signum: int, wait: float = 240, poll: float = 0.1) -> tuple[str, str]:
    """Send ``signum`` to the subprocess ``proc`` once ``ready()`` holds (``what`` names it if it never does
    within ``wait`` seconds, or the process ends first); its (stdout, stderr). The process is killed if the
    test fails on the way."""
    import time

    try:
        deadline = time.monotonic() + wait
        while not ready():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"{what} in {wait:g} s"
            time.sleep(poll)
        proc.send_signal(signum)
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()

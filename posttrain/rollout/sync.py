"""Canaries for a weight sync that silently did nothing (``rollout.sync_check``, ``rollout.sync_timeout``).

A sampler that holds its own copy of the policy (a vLLM engine, colocated or served; the asynchronous
producer's copy) must hold the trainer's weights after every hand-over. When it does not (a name the engine
skips, a sleeping engine woken with stale weights, a copy loop that misses a tensor), training goes on with
rollouts from another policy and nothing else says so. After each hand-over one of two cheap checks runs:

- ``fingerprint``: {name: (Σ x, Σ |x|)} in float64 over 64 strided elements of every parameter, computed on
  both sides and compared within float64 rounding. Exact, for a copy that holds the trainer's tensors under
  the trainer's names (the asynchronous producer's hf/lean copy).
- ``logprobs``: the log-probs of a fixed probe text (``probe_ids``) by the engine and by the trainer's
  forward, equal within ``rollout.sync_tolerance`` (mean |Δ| over its tokens, in nats). For engines whose
  weights are fused, cast or repacked (vLLM): it catches a sync that left the engine on other weights once
  those give the probe log-probs farther than the tolerance from the trainer's (never loaded, loaded under
  wrong names, the checkpoint's weights after training has moved), not one skipped step of a small update.

A failed check stops the run with one line naming the engine and what differed (``WeightSyncError``). A
hand-over that does not return within ``rollout.sync_timeout`` seconds stops it too (``call_with_deadline``).
The hf and lean engines in the training process sample from the trained module itself: nothing to check.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import nn

from posttrain.core import token_logprobs
from posttrain.errors import UserError

SYNC_CHECKS = ("auto", "fingerprint", "logprobs", "off")
SAMPLES_PER_TENSOR = 64
PROBE_LENGTH = 16
FINGERPRINT_RTOL = 1e-9  # float64 sums of the same float32 values, summed in another order: ~1e-16

T = TypeVar("T")


class WeightSyncError(UserError):
    """A weight hand-over to a sampler failed its check or its deadline; the message names the engine."""


def resolve_sync_check(check: str, engine: str, async_steps: int) -> str:
    """The check a run makes: ``auto`` is fingerprint for the asynchronous producer's hf/lean copy, logprobs
    for vLLM, off for an hf/lean engine in the training process (it samples from the trained module)."""
    if check != "auto":
        return check
    if engine == "vllm":
        return "logprobs"
    return "fingerprint" if async_steps else "off"


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[float, float]]:
    """{name: (Σ x_i, Σ |x_i|)} in float64 over at most ``SAMPLES_PER_TENSOR`` elements of each tensor, evenly
    strided from an offset drawn from the name (crc32): the same elements on both sides, a few hundred reads
    per tensor whatever its size."""
    out = {}
    with torch.no_grad():
        for name, tensor in named:
            flat = tensor.detach().reshape(-1)
            stride = max(1, -(-flat.numel() // SAMPLES_PER_TENSOR))
            picked = flat[zlib.crc32(name.encode()) % stride :: stride].double()
            out[name] = (float(picked.sum()), float(picked.abs().sum()))
    return out


def fingerprint_difference(expected: dict, got: dict) -> str | None:
    """Where ``got`` differs from ``expected`` (the trainer's), as a phrase; None when every sum agrees."""
    if expected.keys() != got.keys():
        missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
        return f"its parameters are not the trainer's (missing {missing[:3]}, extra {extra[:3]})"
    for name, (total, size) in expected.items():
        theirs = got[name][0]
        if abs(theirs - total) > FINGERPRINT_RTOL * size + 1e-30:
            return f"parameter {name}: fingerprint {theirs:.9g}, the trainer's {total:.9g}"
    return None


def named_fingerprint(model: nn.Module, names: list[str]) -> dict[str, tuple[float, float]]:
    """``fingerprint`` of the parameters ``names`` of ``model``."""
    parameters = dict(model.named_parameters())
    return fingerprint((name, parameters[name]) for name in names)


PROBE_TEXT = "Weight sync probe: 12 + 30 = 42, and the quick brown fox jumps over the lazy dog."


def probe_ids(tokenizer) -> list[int]:
    """The fixed probe sequence: ``PROBE_TEXT``'s first ``PROBE_LENGTH`` token ids (at least 2)."""
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"][:PROBE_LENGTH]
    if len(ids) < 2:
        raise ValueError("the tokenizer encodes the weight-sync probe text in fewer than 2 tokens")
    return ids


def model_probe_logprobs(model: nn.Module, ids: list[int]) -> list[float]:
    """log π(ids[t] | ids[<t]) for t ≥ 1 by ``model``'s forward at temperature 1 (no gradient)."""
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)
    with torch.no_grad():
        logits = model(input_ids=tokens, use_cache=False).logits
    return token_logprobs(logits[:, :-1], tokens[:, 1:])[0].tolist()


def probe_difference(expected: list[float], got: list[float], tolerance: float) -> str | None:
    """Where the engine's probe log-probs ``got`` differ from the trainer's ``expected`` by more than
    ``tolerance`` on average (mean |Δ| over the probe's tokens, in nats); None when they agree."""
    gap = sum(abs(a - b) for a, b in zip(expected, got, strict=True)) / len(expected)
    if not gap <= tolerance:  # NaN counts as a difference
        return (
            f"the probe's log-probs differ from the trainer's forward by {gap:.3g} nats on average "
            f"(> rollout.sync_tolerance={tolerance:g})"
        )
    return None


def call_with_deadline(fn: Callable[[], T], seconds: float, what: str) -> T:
    """``fn()``, or ``WeightSyncError`` when it has not returned within ``seconds``. It runs in a daemon
    thread; one that hangs is left behind (nothing can stop a hung native call) and the run stops."""
    result: dict = {}
    grad = torch.is_grad_enabled()  # per thread, as is the current CUDA device: the caller's carried over
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def target():
        torch.set_grad_enabled(grad)
        if device is not None:
            torch.cuda.set_device(device)
        try:
            result["value"] = fn()
        except BaseException as err:  # re-raised in the caller's thread
            result["error"] = err

    worker = threading.Thread(target=target, name="posttrain-weight-sync", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise WeightSyncError(
            f"{what} did not finish within rollout.sync_timeout={seconds:g}s; the run stops (raise the timeout "
            "if the model is large and the link slow)"
        )
    if "error" in result:
        raise result["error"]
    return result["value"]


def check_engine_probe(engine_name: str, policy: nn.Module, tokenizer, score: Callable, tolerance: float) -> None:
    """The ``logprobs`` check of an engine with a ``TokenScorer``'s ``score``: its log-probs of the probe against
    ``policy``'s forward; ``WeightSyncError`` naming ``engine_name`` when they differ."""
    ids = probe_ids(tokenizer)
    expected = model_probe_logprobs(policy, ids)
    difference = probe_difference(expected, score([ids], [1])[0], tolerance)
    if difference:
        raise WeightSyncError(
            f"after the weight sync, {engine_name} does not hold the trainer's weights: {difference}; "
            "the run stops (rollout.sync_check=logprobs)"
        )


def check_copy(worker: str, expected: dict[int, dict], checked: dict, request) -> None:
    """The ``fingerprint`` check of the asynchronous producer's copy: the fingerprint the worker took of the
    weights that drew ``request``'s batch against the trainer's of that version (``expected[version]``)."""
    difference = fingerprint_difference(expected[request.version], checked)
    if difference:
        raise WeightSyncError(
            f"the asynchronous producer {worker} drew batch {request.batch} with weights that are not the "
            f"trainer's version {request.version}: {difference}; the run stops (rollout.sync_check=fingerprint)"
        )

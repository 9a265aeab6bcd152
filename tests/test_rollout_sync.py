"""Canaries for a weight sync that did nothing (issue 34 item 5, rollout/sync.py): the asynchronous producer's
copy is fingerprinted against the trainer's weights, a vLLM server's log-probs of a probe against the
trainer's forward, and a hand-over that hangs ends at rollout.sync_timeout. The vLLM engines themselves:
tests/test_vllm.py."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch
from test_async import _grpo

from posttrain.models import ModelConfig, load_policy, load_tokenizer
from posttrain.rollout import RolloutConfig
from posttrain.rollout.sync import (
    WeightSyncError,
    call_with_deadline,
    fingerprint,
    fingerprint_difference,
    model_probe_logprobs,
    probe_ids,
)
from posttrain.runtime.producer import Producer
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.grpo import train as train_grpo


def test_fingerprint_sees_one_changed_element_of_the_sampled_ones_and_nothing_else():
    weights = {"a": torch.arange(1000, dtype=torch.float32).reshape(10, 100), "b": torch.ones(3)}
    same = fingerprint({k: v.clone() for k, v in weights.items()}.items())
    assert fingerprint_difference(fingerprint(weights.items()), same) is None
    changed = {k: v.clone() for k, v in weights.items()}
    changed["b"][1] += 1e-6  # b has 3 elements: every one is sampled
    assert "parameter b" in fingerprint_difference(fingerprint(weights.items()), fingerprint(changed.items()))
    assert "missing ['b']" in fingerprint_difference(fingerprint(weights.items()), fingerprint([("a", weights["a"])]))


def _stale_parameter(monkeypatch) -> dict:
    """Break the producer's weight hand-over on purpose: every publish leaves one tensor of the shared copy at
    its old value (restored just before the lock is released, so the worker always copies the stale one)."""
    seen: dict = {}
    original_init = Producer.__init__

    def init(self, policy, *args, **kwargs):
        original_init(self, policy, *args, **kwargs)
        name = next(n for n in self.names if "mlp" in n)
        seen["name"] = name
        tensor = dict(self.shared.named_parameters())[name]
        lock = self.lock

        class MissesOneTensor:
            def acquire(self, timeout=None):
                taken = lock.acquire(timeout=timeout)
                if taken:
                    self.before = tensor.detach().clone()
                return taken

            def release(self):
                with torch.no_grad():
                    tensor.copy_(self.before)
                lock.release()

        self.lock = MissesOneTensor()

    monkeypatch.setattr(Producer, "__init__", init)
    return seen


def test_a_producer_copy_that_misses_a_tensor_stops_the_run_naming_the_producer(noisy_sft, tmp_path, monkeypatch):
    seen = _stale_parameter(monkeypatch)
    config = _grpo(noisy_sft, tmp_path, "stale", "run.max_steps=3", "rollout.async_steps=1")
    with pytest.raises(WeightSyncError) as caught:
        GRPOTrainer(config).train()
    message = str(caught.value)
    assert "\n" not in message
    assert "producer posttrain-producer-0 drew batch 2" in message
    assert "trainer's version 1" in message and f"parameter {seen['name']}" in message


def test_with_sync_check_off_the_broken_copy_goes_unnoticed(noisy_sft, tmp_path, monkeypatch):
    """The canary is what stops the run above: turned off, the same broken hand-over trains to the end."""
    _stale_parameter(monkeypatch)
    config = _grpo(noisy_sft, tmp_path, "off", "run.max_steps=3", "rollout.async_steps=1", "rollout.sync_check=off")
    assert train_grpo(config)["steps"] == 3


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"sync_check": "fingerprint", "engine": "vllm"}, "vLLM fuses and casts"),
        ({"sync_check": "logprobs", "engine": "lean", "async_steps": 1}, "applies to engine=vllm"),
        ({"sync_check": "fingerprint", "engine": "lean"}, "async_steps >= 1"),
        ({"sync_check": "hash"}, "sync_check must be one of"),
        ({"sync_timeout": 0}, "sync_timeout must be > 0"),
    ],
)
def test_sync_settings_that_cannot_hold_fail_at_start(overrides, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**overrides).validate()


def test_a_hand_over_that_hangs_ends_at_the_deadline():
    start = time.perf_counter()
    with pytest.raises(WeightSyncError, match=r"vLLM's reload did not finish within rollout.sync_timeout=0.2s"):
        call_with_deadline(lambda: time.sleep(30), 0.2, "vLLM's reload")
    assert time.perf_counter() - start < 10  # generous: it does not wait for the hung call
    assert call_with_deadline(lambda: 7, 5, "x") == 7
    with pytest.raises(KeyError):  # the hand-over's own error comes through as it was
        call_with_deadline(lambda: {}["k"], 5, "x")


class _FakeServer:
    """A stand-in for `posttrain vllm-serve` on a real socket: /health, /load_weights (which can hang), /score
    answering the log-probs of a model of our choosing (the one the "server" holds)."""

    def __init__(self, model, hang: float = 0.0):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, payload):
                body = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._answer({"model": "fake", "weight_loads": 0})

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/load_weights":
                    time.sleep(hang)
                    self._answer({"tensors": 0})
                else:
                    request = json.loads(body)
                    ids = request["sequences"][0]
                    self._answer({"logprobs": [model_probe_logprobs(server.model, ids)]})

            def log_message(self, *args):
                pass

        self.model = model
        self.http = HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def close(self):
        self.http.shutdown()
        self.http.server_close()


def _served(tiny_dir, server_model, **sync):
    from posttrain.rollout.vllm_server import VLLMServerEngine

    path = str(tiny_dir / "policy")
    server = _FakeServer(server_model, **{k: sync.pop(k) for k in ("hang",) if k in sync})
    engine = VLLMServerEngine(server.url, load_tokenizer(path), 30, sync=(True, 0.1, sync.get("timeout", 30)))
    return server, engine


def test_a_served_engine_left_on_other_weights_stops_the_run_naming_the_server(tiny_dir):
    path = str(tiny_dir / "policy")
    policy = load_policy(ModelConfig(path=path, device="cpu"))
    server, engine = _served(tiny_dir, load_policy(ModelConfig(path=path, device="cpu")))
    try:
        engine.sync_weights(policy)  # the server holds the same weights: passes
        with torch.no_grad():
            for p in policy.parameters():  # the trainer moves on; the server ignores what it is sent
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        with pytest.raises(WeightSyncError, match=rf"vLLM server at {server.url} does not hold the trainer's"):
            engine.sync_weights(policy)
    finally:
        server.close()


def test_a_served_hand_over_that_hangs_stops_at_sync_timeout(tiny_dir):
    path = str(tiny_dir / "policy")
    policy = load_policy(ModelConfig(path=path, device="cpu"))
    server, engine = _served(tiny_dir, policy, hang=2.0, timeout=0.5)
    try:
        with pytest.raises(WeightSyncError, match=r"/load_weights\) did not finish within rollout.sync_timeout=0.5s"):
            engine.sync_weights(policy)
    finally:
        server.close()


def test_the_probe_is_a_fixed_text_of_several_tokens(tiny_dir):
    tokenizer = load_tokenizer(str(tiny_dir / "policy"))
    assert probe_ids(tokenizer) == probe_ids(tokenizer) and 2 <= len(probe_ids(tokenizer)) <= 16


def test_a_weight_sync_error_in_the_producer_process_reaches_the_trainer_as_one_line(tiny_dir):
    """The asynchronous producer syncs a vLLM server that keeps other weights: the worker's WeightSyncError
    (a UserError) comes back as itself, in one line, not as a ProducerError carrying its traceback."""
    from posttrain.data import PromptExample
    from posttrain.rollout import SamplingParams

    path = str(tiny_dir / "policy")
    policy = load_policy(ModelConfig(path=path, device="cpu"))
    server_model = load_policy(ModelConfig(path=path, device="cpu"))
    with torch.no_grad():
        for p in server_model.parameters():  # the server holds weights the trainer never had
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    server = _FakeServer(server_model)
    config = RolloutConfig(
        engine="vllm", mode="server", server_url=server.url, async_steps=1, sync_check="logprobs", sync_tolerance=0.1
    )
    producer = Producer(policy, config, SamplingParams(max_new_tokens=2), path, path, 0, 0, 0)
    try:
        producer.request(0, [PromptExample([1, 2, 3], "x", {})], 1)
        with pytest.raises(WeightSyncError) as caught:
            producer.take(0)
    finally:
        producer.close()
        server.close()
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    assert f"vLLM server at {server.url} does not hold the trainer's weights" in message

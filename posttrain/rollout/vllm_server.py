"""vLLM in its own process: ``posttrain vllm-serve --model PATH`` and the trainer's client engine.

Split generation, as TRL's and verl's server modes do: the server holds a ``VLLMEngine`` (on other
GPUs in production, on CPU in the tests) and the trainer talks to it over HTTP:

    GET  /health        → {"model": path, "weight_loads": hand-overs served}
    POST /generate      {"prompts": [[id, ...]], "params": {SamplingParams fields}, "n": G}
                        → {"completions": [{"token_ids", "logprobs", "stopped"}], "stop_ids": [...]}
    POST /load_weights  body: the weights as safetensors bytes → {"tensors": count}
    POST /score         {"sequences": [[id, ...]], "starts": [int]} → {"logprobs": [[float, ...]]}
                        (the served model grading given tokens: a distillation teacher in its own process)

Weights travel as one safetensors blob per sync: simple and exact, and fine for small models or
a fast link; a 7B model moves ~14 GB per step this way (NCCL broadcast, as TRL's server mode does
it, is the lever for that and is not built here). The server handles one request at a time, which
is what a single vLLM engine can serve from one thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer

from torch import nn

from posttrain.errors import UserError
from posttrain.rollout.base import Rollout, SamplingParams
from posttrain.rollout.hf import eos_token_ids
from posttrain.rollout.sync import WeightSyncError, check_engine_probe
from posttrain.rollout.vllm_engine import VLLMEngine, check_vllm_logprobs, policy_weights, rollout_from_completions


class VLLMServerError(RuntimeError):
    """The vLLM server is unreachable, too slow, or failed a request."""


class VLLMServerEngine:
    """The rollout engine of a trainer whose vLLM runs as ``posttrain vllm-serve`` (rollout.mode=server), and
    the ``TokenScorer`` of a teacher served so (distill's teacher_scoring.mode=server)."""

    logprobs_exact = False

    def __init__(
        self,
        url: str,
        tokenizer,
        timeout: float = 300.0,
        section: str = "rollout",
        sync: tuple[bool, float, float] = (False, 0.5, 600.0),
        full_logprobs: bool = False,
    ):
        self.url = url.rstrip("/")
        # rollout.sync_check=logprobs (the probe scored after each hand-over), sync_tolerance, sync_timeout
        self.check_sync, self.sync_tolerance, self.sync_timeout = sync
        self.full_logprobs = full_logprobs  # rollout.behaviour_logprobs=full: refused with top-k / top-p
        self.section = section  # the config section that points here, named in errors
        self.tokenizer = tokenizer
        self.timeout = timeout
        self._eos = eos_token_ids(tokenizer)
        # loopback and cluster-internal addresses: never through an HTTP proxy from the environment
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:  # fail at start, not at the first rollout: a server not started (yet) is the user's to fix
            self.model = self._call("/health")["model"]
        except VLLMServerError as err:
            raise UserError(str(err)) from err

    def _call(
        self, path: str, body: bytes | None = None, content_type: str = "application/json", timeout: float | None = None
    ) -> dict:
        request = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": content_type})
        try:
            with self._opener.open(request, timeout=timeout or self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise VLLMServerError(f"vLLM server {self.url}{path} failed: {err.code} {err.read()[:2000]!r}") from err
        except (urllib.error.URLError, OSError) as err:  # refused, reset, timed out
            reason = getattr(err, "reason", err)
            waited = f" within {self.timeout:g}s" if isinstance(reason, TimeoutError) else ""
            raise VLLMServerError(
                f"vLLM server at {self.url} did not answer {path}{waited} ({reason}); is "
                f"`posttrain vllm-serve --model PATH` running there? ({self.section}.server_url, "
                f"{self.section}.server_timeout)"
            ) from err

    def sync_weights(self, policy: nn.Module) -> None:
        """Send the policy's weights (merged for LoRA) to the server. With several training processes
        (one server for all) the first process sends them once, and no process samples before they are in."""
        import torch.distributed as dist
        from safetensors.torch import save

        weights = policy_weights(policy)  # on every process: gathering FSDP2 shards is a collective
        several = dist.is_initialized() and dist.get_world_size() > 1
        if not several or dist.get_rank() == 0:
            # clones: safetensors refuses tensors that share storage (tied embeddings)
            blob = save({name: tensor.detach().cpu().contiguous().clone() for name, tensor in weights})
            self._load(blob)
        if several:
            dist.barrier()
        if self.check_sync:  # every process: the probe's forward on a sharded policy is a collective
            check_engine_probe(
                f"the vLLM server at {self.url}", policy, self.tokenizer, self.score, self.sync_tolerance
            )

    def _load(self, blob: bytes) -> None:
        """POST the weights; a hand-over slower than rollout.sync_timeout is a ``WeightSyncError``."""
        try:
            self._call("/load_weights", blob, "application/octet-stream", timeout=self.sync_timeout)
        except VLLMServerError as err:
            if not isinstance(getattr(err.__cause__, "reason", err.__cause__), TimeoutError):
                raise
            raise WeightSyncError(
                f"the weight hand-over to the vLLM server at {self.url} (/load_weights) did not finish within "
                f"rollout.sync_timeout={self.sync_timeout:g}s; the run stops (raise it if the model is large and "
                "the link slow)"
            ) from err

    def generating(self, policy: nn.Module):
        return contextlib.nullcontext()

    def score(self, sequences: list[list[int]], starts: list[int]) -> list[list[float]]:
        """``TokenScorer``: the served model's log-probs of given tokens (``VLLMEngine.score``)."""
        request = {"sequences": [list(s) for s in sequences], "starts": list(starts)}
        return self._call("/score", json.dumps(request).encode())["logprobs"]

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> Rollout:
        params.validate()
        check_vllm_logprobs(params, self.full_logprobs)
        request = {"prompts": [list(p) for p in prompts], "params": dataclasses.asdict(params), "n": n}
        answer = self._call("/generate", json.dumps(request).encode())
        stop_ids = sorted(set(self._eos) | set(params.stop_token_ids))
        return rollout_from_completions(
            self.tokenizer, prompts, answer["completions"], stop_ids, n, params.logprob_temperature
        )


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, **engine_kwargs) -> None:
    """Serve ``VLLMEngine(model, **engine_kwargs)`` until interrupted."""
    from safetensors.torch import load

    from posttrain.models import load_tokenizer

    engine = VLLMEngine(model, load_tokenizer(model), **engine_kwargs)

    loads = [0]  # weight hand-overs served (/health reports it)

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._answer(200, {"model": model, "weight_loads": loads[0]})
            else:
                self._answer(404, {"error": f"no GET {self.path}"})

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            try:
                if self.path == "/generate":
                    request = json.loads(body)
                    params = SamplingParams(**request["params"])
                    completions, stop_ids = engine.sample(request["prompts"], params, request["n"])
                    self._answer(200, {"completions": completions, "stop_ids": stop_ids})
                elif self.path == "/score":
                    request = json.loads(body)
                    self._answer(200, {"logprobs": engine.score(request["sequences"], request["starts"])})
                elif self.path == "/load_weights":
                    weights = load(body)
                    engine.load(list(weights.items()))
                    loads[0] += 1
                    self._answer(200, {"tensors": len(weights)})
                else:
                    self._answer(404, {"error": f"no POST {self.path}"})
            except Exception as err:  # the trainer gets the reason, the server keeps serving
                self._answer(500, {"error": f"{type(err).__name__}: {err}"})

        def log_message(self, format, *args):  # one line per request is noise at several per step
            pass

    server = HTTPServer((host, port), Handler)
    print(f"posttrain vllm-serve: {model} on http://{host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()

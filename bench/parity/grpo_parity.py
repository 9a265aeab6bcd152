"""GRPO on the fixed batch through TRL's ``GRPOTrainer`` and through posttrain's ``GRPOTrainer`` methods.

TRL: the trainer is built as a user builds it (the tiny model, a reward function reading the fixed rewards
from a dataset column); generation is replaced by the fixed completions (``_generate_single_turn`` returns
them), and the rest runs as shipped: ``_generate_and_score_completions`` tokenizes the prompts, takes the
old (μ > 1) and reference log-probs and computes the advantages; ``compute_loss`` gives each accumulation
step's loss, back-propagated as ``Trainer.training_step`` does (TRL's GRPO loss is already scaled for
gradient accumulation).

posttrain: the trainer's own methods on the same rows: old log-probs by ``policy_logprobs`` (the trainer's
``logprobs_of``), the reference's by ``reference_logprobs``, ``GRPOTrainer.advantages``, then the update of
``GRPOTrainer.update`` for one minibatch: ``MinibatchUpdate`` over micro-batches of
``GRPOTrainer.policy_loss``, each backward with its share. The optimizer step is not taken: the gradients
are compared. ``self`` is a namespace holding what those methods read (config, accelerator, actor, shared).

With μ > 1 the policy is perturbed (the same seeded noise on both sides) after the old log-probs are taken, so
the ratio is not 1 and the clip acts; the reference is always perturbed, so the KL term is not 0.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import fixtures as fx
import torch

POLICY_SEED, REF_SEED = 1, 2
# TRL 1.16 multiplies the KL term by the (differentiable) ratio by default (DeepSeek-V3.2); posttrain adds
# β·k3 as DeepSeekMath eq. 3 writes it. Off for the equal cases; the case "kl bias correction" keeps it on.
TRL_DEFAULTS = {"use_bias_correction_kl": False}
POLICY_NOISE, REF_NOISE = 0.3, 0.1  # × each parameter's RMS: ratios 0.66-1.74 (30 % outside [0.8, 1.2]), k3 ~ 4e-3


@dataclass
class Case:
    """One setting on both sides. ``ga``: TRL's gradient_accumulation_steps, and posttrain's micro-batches per
    minibatch (micro_batch_size = B / ga). ``equal``: whether the two must agree (else: a difference by design,
    measured and explained in docs/parity.md)."""

    name: str
    trl: dict
    posttrain: dict
    ga: int = 1
    equal: bool = True
    notes: str = ""


CASES = [
    Case("grpo", {"loss_type": "grpo", "beta": 0.04}, {"preset": "grpo", "kl_coef": 0.04}),
    Case("grpo, mu=2", {"loss_type": "grpo", "beta": 0.04, "num_iterations": 2},
         {"preset": "grpo", "kl_coef": 0.04, "num_iterations": 2}),
    Case("grpo, mu=2, posttrain shared_prefix=false", {"loss_type": "grpo", "beta": 0.04, "num_iterations": 2},
         {"preset": "grpo", "kl_coef": 0.04, "num_iterations": 2, "shared_prefix": False},
         notes="TRL's padded layout on both sides"),
    Case("bnpo, mu=2", {"loss_type": "bnpo", "beta": 0.04, "num_iterations": 2},
         {"loss_agg": "token-mean", "kl_coef": 0.04, "num_iterations": 2}),
    Case("dr_grpo, mu=2", {"loss_type": "dr_grpo", "scale_rewards": "none", "beta": 0.04, "num_iterations": 2},
         {"preset": "dr_grpo", "kl_coef": 0.04, "num_iterations": 2}),
    Case("dapo, mu=2", {"loss_type": "dapo", "beta": 0.0, "epsilon_high": 0.28, "num_iterations": 2},
         {"preset": "dapo", "num_iterations": 2}),
    Case("grpo, scale=batch", {"loss_type": "grpo", "scale_rewards": "batch", "beta": 0.0, "num_iterations": 2},
         {"scale_rewards": "batch", "kl_coef": 0.0, "num_iterations": 2}),
    Case("grpo, scale=none, beta=0.1", {"loss_type": "grpo", "scale_rewards": "none", "beta": 0.1,
                                        "epsilon": 0.1, "epsilon_high": 0.3, "num_iterations": 2},
         {"scale_rewards": "none", "kl_coef": 0.1, "clip_low": 0.1, "clip_high": 0.3, "num_iterations": 2}),
    Case("gspo (sequence ratio), mu=2",
         {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.0, "epsilon": 3e-4,
          "epsilon_high": 4e-4, "num_iterations": 2},
         {"policy_loss": "gspo", "loss_agg": "seq-mean-token-mean", "kl_coef": 0.0, "clip_low": 3e-4,
          "clip_high": 4e-4, "num_iterations": 2}),
    Case("cispo, mu=2", {"loss_type": "cispo", "beta": 0.0, "epsilon_high": 1.28, "num_iterations": 2},
         {"preset": "cispo", "num_iterations": 2}),
    Case("dapo, 2 accumulation steps", {"loss_type": "dapo", "beta": 0.04, "num_iterations": 2},
         {"loss_agg": "token-mean", "kl_coef": 0.04, "num_iterations": 2}, ga=2),
    Case("grpo, 2 accumulation steps", {"loss_type": "grpo", "beta": 0.04, "num_iterations": 2},
         {"preset": "grpo", "kl_coef": 0.04, "num_iterations": 2}, ga=2),
    Case("dr_grpo, 2 accumulation steps", {"loss_type": "dr_grpo", "scale_rewards": "none", "beta": 0.04,
                                           "num_iterations": 2},
         {"preset": "dr_grpo", "kl_coef": 0.04, "num_iterations": 2}, ga=2),
    Case("bnpo, 2 accumulation steps", {"loss_type": "bnpo", "beta": 0.04, "num_iterations": 2},
         {"loss_agg": "token-mean", "kl_coef": 0.04, "num_iterations": 2}, ga=2, equal=False,
         notes="TRL's bnpo divides each accumulation step by its own token count"),
    Case("kl bias correction (TRL default)", {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": True},
         {"preset": "grpo", "kl_coef": 0.04}, equal=False,
         notes="TRL multiplies the KL term by the ratio (value 1, gradient not 0); posttrain adds β·k3 unweighted"),
]  # fmt: skip


def fixed_reward(completions, reward, **kwargs):
    """The batch's fixed rewards, from the dataset column ``reward``."""
    return list(reward)


def trl_side(model_dir: Path, batch: fx.GRPOBatch, case: Case, dtype: torch.dtype, out: Path) -> dict:
    """(per-token log-probs, advantages, loss, gradients) of TRL's GRPOTrainer on the fixed batch."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    B = len(batch.completions)
    args = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=B // case.ga, gradient_accumulation_steps=case.ga,
        num_generations=fx.G, max_completion_length=fx.MAX_NEW_TOKENS, temperature=fx.TEMPERATURE,
        use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=1, dataloader_num_workers=0, seed=0, **{**TRL_DEFAULTS, **case.trl},
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    dataset = Dataset.from_list([{"prompt": p, "reward": 0.0} for p in batch.prompts[:: fx.G]])
    trainer = GRPOTrainer(fx.load(model_dir, dtype), fixed_reward, args, dataset, processing_class=tokenizer)
    seen = {}

    def fixed_completions(prompt_ids, images, multimodal_fields, num_generations):
        seen["prompt_ids"] = [list(ids) for ids in prompt_ids]
        return [list(c) for c in batch.completions], None

    trainer._generate_single_turn = fixed_completions
    if trainer.ref_model is not None:
        fx.perturb(trainer.ref_model, REF_SEED, REF_NOISE)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = case.ga  # what Trainer's loop sets before each step
    rows = [{"prompt": p, "reward": r} for p, r in zip(batch.prompts, batch.rewards, strict=True)]
    with fx.exact_lm_head(dtype == torch.float64), fx.default_dtype(dtype):
        scored = trainer._generate_and_score_completions(rows)
        if case.trl.get("num_iterations", 1) > 1:
            fx.perturb(trainer.model, POLICY_SEED, POLICY_NOISE)
        loss = 0.0
        for chunk in _accumulation_steps(scored, case.ga):
            step_loss = trainer.compute_loss(trainer.model, chunk)
            step_loss.backward()  # Trainer.training_step: GRPO's loss is already scaled for accumulation
            loss = loss + step_loss.detach()
    return {
        "prompt_ids": seen["prompt_ids"], "advantages": scored["advantages"], "loss": loss,
        "old_logprobs": scored.get("old_per_token_logps"), "ref_logprobs": scored.get("ref_per_token_logps"),
        "mask": scored["completion_mask"], "grads": fx.grads(trainer.model), "model": trainer.model,
        "clip_ratio": trainer._metrics["train"].get("clip_ratio/region_mean", [None])[-1],
    }  # fmt: skip


def _accumulation_steps(scored: dict, ga: int) -> list[dict]:
    """The generation batch cut into ``ga`` consecutive slices, as ``split_tensor_dict`` cuts it (TRL shuffles
    the rows first; the rows stay in order here, so that both sides see the same micro-batches)."""
    B = scored["advantages"].shape[0]
    out = []
    for k in range(ga):
        rows = slice(k * B // ga, (k + 1) * B // ga)
        out.append(
            {key: v[rows] if torch.is_tensor(v) and v.dim() and v.shape[0] == B else v for key, v in scored.items()}
        )
    return out


def rollout_of(prompt_ids: list[list[int]], batch: fx.GRPOBatch, tokenizer):
    """posttrain's ``Rollout`` of the fixed batch: prompts left-padded, completions right-padded to T."""
    from posttrain.rollout import Rollout

    B, T, P = len(batch.completions), fx.MAX_NEW_TOKENS, max(len(p) for p in prompt_ids)
    prompts = torch.full((B, P), fx.PAD_ID, dtype=torch.long)
    prompt_mask = torch.zeros((B, P), dtype=torch.long)
    responses = torch.full((B, T), fx.PAD_ID, dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, batch.completions, strict=True)):
        prompts[i, P - len(p) :], prompt_mask[i, P - len(p) :] = torch.tensor(p), 1
        responses[i, : len(c)], response_mask[i, : len(c)] = torch.tensor(c), 1
    return Rollout(
        prompt_ids=prompts, prompt_mask=prompt_mask, response_ids=responses, response_mask=response_mask,
        logprobs=None, truncated=torch.tensor([c[-1] != fx.EOS_ID for c in batch.completions]),
        prompt_index=torch.arange(B) // fx.G, prompts=batch.prompts,
        responses=tokenizer.batch_decode(batch.completions, skip_special_tokens=True), group_size=fx.G,
        temperature=fx.TEMPERATURE,
    )  # fmt: skip


def posttrain_config(case: Case, B: int, model_dir: Path):
    from posttrain.models import ModelConfig
    from posttrain.rewards import RewardSpec
    from posttrain.rollout import SamplingParams
    from posttrain.runtime.config import RunConfig
    from posttrain.trainers.grpo import GRPOConfig

    prompts = model_dir.parent / "prompts.jsonl"  # read by validate's checks only: the rows come from the batch
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in fx.grpo_batch().prompts[:: fx.G]))
    config = GRPOConfig(
        model=ModelConfig(path=str(model_dir)),
        data=dataclasses.replace(GRPOConfig().data, path=str(prompts)),
        num_generations=fx.G,
        sampling=SamplingParams(max_new_tokens=fx.MAX_NEW_TOKENS, temperature=fx.TEMPERATURE),
        run=RunConfig(batch_size=B, micro_batch_size=B // case.ga),
        rewards=[RewardSpec(function="posttrain.rewards.builtin:starts_with_answer")],  # not called
        **case.posttrain,
    )
    config.validate()
    return config


def posttrain_side(model_dir: Path, batch: fx.GRPOBatch, case: Case, dtype: torch.dtype, prompt_ids) -> dict:
    """The same quantities through posttrain's GRPOTrainer methods (module docstring)."""
    from accelerate import Accelerator
    from transformers import AutoTokenizer

    from posttrain.core import kl_penalty
    from posttrain.models import Reference
    from posttrain.runtime.online import policy_logprobs, reference_logprobs
    from posttrain.runtime.prefix import resolve_shared_prefix
    from posttrain.runtime.update import MinibatchUpdate
    from posttrain.trainers.grpo import GRPOBatch, GRPOTrainer

    B = len(batch.completions)
    cfg = posttrain_config(case, B, model_dir)
    policy = fx.load(model_dir, dtype)
    reference = Reference(model=fx.load(model_dir, dtype)) if cfg.kl_coef > 0 else None
    if reference is not None:
        fx.perturb(reference.model, REF_SEED, REF_NOISE)
    acc = Accelerator(cpu=True)
    shared = resolve_shared_prefix(
        cfg.shared_prefix, [policy] + ([reference.model] if reference else []), lambda line: None
    )
    shared.prompt_cache = cfg.shared_prefix == "auto" and shared.enabled  # as GRPOTrainer.__init__, one process
    trainer = SimpleNamespace(config=cfg, accelerator=acc, actor=SimpleNamespace(model=policy), passes=Counter(),
                              shared=shared, tally=None)  # fmt: skip
    rollout = rollout_of(prompt_ids, batch, AutoTokenizer.from_pretrained(model_dir))
    mask = rollout.action_mask
    with torch.no_grad():
        old = policy_logprobs(policy, rollout, slice(None), acc.device, shared=shared)[0]  # the trainer's logprobs_of
    ref = kl = None
    if reference is not None:
        ref = reference_logprobs(reference, rollout, cfg.run.micro_batch_size, acc.device, shared)
        kl = kl_penalty(old, ref, "k1" if cfg.kl_in == "reward" else cfg.kl_estimator)
    scores = torch.tensor(batch.rewards, dtype=dtype)
    advantages = GRPOTrainer.advantages(trainer, scores, torch.ones(B, dtype=torch.bool), kl, mask)
    if cfg.num_iterations > 1:
        fx.perturb(policy, POLICY_SEED, POLICY_NOISE)
    minibatch = GRPOBatch(rollout, mask, advantages, old, ref if cfg.kl_in == "loss" else None)
    update = MinibatchUpdate(acc, trainer.actor, mask, cfg.loss_agg, cfg.run.micro_batch_size)
    clipfrac = []
    for micro in update:
        loss, stats, _ = GRPOTrainer.policy_loss(trainer, minibatch, micro.rows, with_entropy=False)
        update.backward(micro, loss, stats)
        clipfrac.append(float(stats["clipfrac"]))
    return {
        "advantages": advantages, "loss": update.loss, "old_logprobs": old, "ref_logprobs": ref, "mask": mask,
        "grads": fx.grads(policy), "model": policy, "clipfrac": sum(clipfrac) / len(clipfrac),
    }  # fmt: skip


def run_case(model_dir: Path, case: Case, dtype: torch.dtype) -> dict:
    """Both sides on one case; the differences (module ``fixtures``: max |Δ| and that / max |TRL's|)."""
    batch = fx.grpo_batch()
    with tempfile.TemporaryDirectory() as out:
        trl = trl_side(model_dir, batch, case, dtype, Path(out))
    ours = posttrain_side(model_dir, batch, case, dtype, trl["prompt_ids"])
    if case.trl.get("num_iterations", 1) > 1 and not fx.weights_equal(trl["model"], ours["model"]):
        raise AssertionError(f"{case.name}: the perturbed policies differ between the two sides")
    mask = ours["mask"].bool()
    result = {"case": case.name, "dtype": str(dtype).removeprefix("torch."), "equal_expected": case.equal,
              "notes": case.notes, "clipfrac": ours["clipfrac"]}  # fmt: skip
    result["advantages"] = fx.difference(ours["advantages"], trl["advantages"])
    for key in ("old_logprobs", "ref_logprobs"):
        if trl[key] is not None and ours[key] is not None:
            result[key] = fx.difference(ours[key][mask], trl[key][mask])
    result["loss_values"] = (float(ours["loss"]), float(trl["loss"]))
    result["loss"] = fx.difference(ours["loss"], trl["loss"])
    result["grad"] = fx.grad_difference(ours["grads"], trl["grads"])
    return result

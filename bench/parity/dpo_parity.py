"""DPO on fixed pairs through TRL's ``DPOTrainer`` and through posttrain's DPO task.

TRL: the trainer is built as a user builds it (the tiny model, a reference model passed as ``ref_model``, the
pairs as a dataset it tokenizes, appending EOS); one batch of its own collator goes through ``compute_loss``
and is back-propagated as ``Trainer.training_step`` does with one accumulation step.

posttrain: the same token ids (TRL's tokenization, so that both sides score the same sequences) as
``PreferenceExample`` rows, collated by ``DPOTask.collate`` (shared-prefix packing as ``posttrain dpo`` resolves
it), through ``loop.accumulate_gradients``: the forward, ``DPOTask.loss`` and the backward of one step of
``posttrain dpo``. The reference is perturbed (the same seeded noise on both sides) so that h ≠ 0.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import fixtures as fx
import torch

REF_SEED, REF_NOISE = 3, 0.1


@dataclass
class Case:
    name: str
    trl: dict
    posttrain: dict
    equal: bool = True
    notes: str = ""


CASES = [
    Case("sigmoid, beta=0.1", {"loss_type": ["sigmoid"], "beta": 0.1}, {"loss_type": "sigmoid", "beta": 0.1}),
    Case("sigmoid, beta=0.5", {"loss_type": ["sigmoid"], "beta": 0.5}, {"loss_type": "sigmoid", "beta": 0.5}),
    Case("hinge, beta=0.1", {"loss_type": ["hinge"], "beta": 0.1}, {"loss_type": "hinge", "beta": 0.1}),
    Case("ipo, beta=0.1", {"loss_type": ["ipo"], "beta": 0.1},
         {"loss_type": "ipo", "beta": 0.1, "ipo_logps": "mean"}),
    Case("ipo, posttrain ipo_logps=sum", {"loss_type": ["ipo"], "beta": 0.1},
         {"loss_type": "ipo", "beta": 0.1, "ipo_logps": "sum"}, equal=False,
         notes="posttrain's default IPO reads the summed log-likelihood (the paper's); TRL's the per-token mean"),
    Case("label smoothing 0.1: TRL robust, posttrain cDPO", {"loss_type": ["robust"], "beta": 0.1,
                                                             "label_smoothing": 0.1},
         {"loss_type": "sigmoid", "beta": 0.1, "label_smoothing": 0.1}, equal=False,
         notes="TRL 1.16's sigmoid has no label smoothing; its robust DPO divides by 1 − 2ε and subtracts the "
               "flipped term, posttrain's cDPO adds it"),
]  # fmt: skip


def trl_side(model_dir: Path, pairs: list[dict], case: Case, dtype: torch.dtype, out: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(out), per_device_train_batch_size=len(pairs), gradient_accumulation_steps=1,
        precompute_ref_log_probs=False, max_length=None, use_cpu=True, bf16=False, fp16=False, report_to="none",
        save_strategy="no", disable_tqdm=True, logging_steps=1, dataloader_num_workers=0, seed=0, **case.trl,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = fx.load(model_dir, dtype)
    fx.perturb(reference, REF_SEED, REF_NOISE)
    trainer = DPOTrainer(
        fx.load(model_dir, dtype), reference, args=args, train_dataset=Dataset.from_list(pairs),
        processing_class=tokenizer,
    )  # fmt: skip
    keys = ("prompt_ids", "chosen_ids", "rejected_ids")
    rows = [{k: trainer.train_dataset[i][k] for k in keys} for i in range(len(pairs))]
    trainer.model.train()
    with fx.exact_lm_head(dtype == torch.float64):
        loss = trainer.compute_loss(trainer.model, trainer.data_collator(rows))
        loss.backward()  # one accumulation step: Trainer.training_step back-propagates it as it is
    return {"rows": rows, "loss": loss.detach(), "grads": fx.grads(trainer.model)}


def posttrain_side(model_dir: Path, rows: list[dict], case: Case, dtype: torch.dtype) -> dict:
    from accelerate import Accelerator

    from posttrain.data import PreferenceExample
    from posttrain.models import ModelConfig, Reference
    from posttrain.runtime.loop import accumulate_gradients
    from posttrain.runtime.prefix import resolve_shared_prefix
    from posttrain.trainers.dpo import DPOConfig, DPOExample, DPOTask

    data = model_dir.parent / "pairs.jsonl"  # read by validate's checks only: the rows are TRL's token ids
    data.write_text("".join(json.dumps(p) + "\n" for p in fx.dpo_pairs()))
    config = DPOConfig(model=ModelConfig(path=str(model_dir)), **case.posttrain)
    config.data.path = str(data)
    config.validate()
    policy, reference = fx.load(model_dir, dtype), Reference(model=fx.load(model_dir, dtype))
    fx.perturb(reference.model, REF_SEED, REF_NOISE)
    task = DPOTask(reference, fx.PAD_ID, config)
    task.shared = resolve_shared_prefix(
        config.shared_prefix, [policy, reference.model], lambda line: None
    )  # as dpo.train
    examples = [DPOExample(PreferenceExample(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"])) for r in rows]
    policy.train()
    _, step_loss = accumulate_gradients(Accelerator(cpu=True), task, policy, [task.collate(examples)])
    return {"loss": step_loss, "grads": fx.grads(policy)}


def run_case(model_dir: Path, case: Case, dtype: torch.dtype) -> dict:
    pairs = fx.dpo_pairs()
    with tempfile.TemporaryDirectory() as out:
        trl = trl_side(model_dir, pairs, case, dtype, Path(out))
    ours = posttrain_side(model_dir, trl["rows"], case, dtype)
    return {
        "case": case.name, "dtype": str(dtype).removeprefix("torch."), "equal_expected": case.equal,
        "notes": case.notes, "loss_values": (float(ours["loss"]), float(trl["loss"])),
        "loss": fx.difference(ours["loss"], trl["loss"]), "grad": fx.grad_difference(ours["grads"], trl["grads"]),
    }  # fmt: skip

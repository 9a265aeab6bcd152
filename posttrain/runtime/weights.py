"""One copy of the weights per checkpoint: the Hugging Face folders ``hf/<role>`` hold them, and
accelerate's ``state/`` holds only the optimizer, scheduler and RNG states.

``save_state`` is run with a pre-hook that drops the saved roles' weights from what accelerate
writes, and records which of its models they were (``state/weights_in_hf.json``); ``load_state``
is run with a pre-hook that takes those models out of accelerate's hands and loads each from its
Hugging Face folder, tensor for tensor (resume stays bit-exact). FSDP and DeepSpeed shard the
weights inside ``save_state``, so with them accelerate keeps its own copy as before; a checkpoint
without the record (an older one) loads the same way.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from accelerate.utils import DistributedType

from posttrain.models.roles import PolicyWithValueHead, RewardScorer, ValueModel, is_peft_model

RECORD = "weights_in_hf.json"
SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


@contextlib.contextmanager
def weights_left_to_hf(accelerator, models: dict):
    """Around ``accelerator.save_state``: the weights of ``models`` ({role: model}) are not
    written there (``save_checkpoint`` writes them to ``hf/<role>``)."""
    if accelerator.distributed_type in SHARDED:
        yield
        return
    by_model = {id(accelerator.unwrap_model(m)): role for role, m in models.items()}
    found = ((i, by_model.get(id(accelerator.unwrap_model(m)))) for i, m in enumerate(accelerator._models))
    roles = {i: role for i, role in found if role is not None}  # other prepared models keep their state copy

    def hook(_models, weights, output_dir):
        for i in sorted(roles, reverse=True):
            del weights[i]
        if accelerator.is_main_process:
            (Path(output_dir) / RECORD).write_text(json.dumps({str(i): role for i, role in roles.items()}))

    handle = accelerator.register_save_state_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def weights_from_hf(accelerator, checkpoint: Path):
    """Around ``accelerator.load_state(checkpoint / "state")``: the models recorded by
    ``weights_left_to_hf`` are loaded from ``checkpoint / "hf" / <role>`` instead."""
    record = checkpoint / "state" / RECORD
    if not record.is_file():
        yield
        return
    roles = {int(i): role for i, role in json.loads(record.read_text()).items()}

    def hook(models, _input_dir):
        for i in sorted(roles, reverse=True):
            restore_weights(accelerator.unwrap_model(models.pop(i)), checkpoint / "hf" / roles[i])

    handle = accelerator.register_load_state_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def restore_weights(model, folder: Path) -> None:
    """Load what ``model.save_pretrained(folder)`` wrote back into ``model``, in place and exactly.

    A PEFT model gets its trained adapter back (and its modules_to_save; the frozen base is as
    loaded); a shared-critic policy its backbone and ``value_head.safetensors``; a reward scorer or
    value model the Hugging Face model it wraps. Weights tied to a loaded tensor (an output
    embedding saved once) need no file of their own; anything else missing is an error.
    """
    from safetensors.torch import load_file

    if isinstance(model, RewardScorer | ValueModel):  # saved as the Hugging Face model inside
        restore_weights(model.model, folder)
        return
    if isinstance(model, PolicyWithValueHead):
        restore_weights(model.policy, folder)
        model.v_head.load_state_dict(load_file(folder / "value_head.safetensors"))
        return
    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(folder / "adapter_model.safetensors"))
        if result.unexpected_keys:
            raise RuntimeError(f"{folder}: adapter weights the model does not have: {result.unexpected_keys[:5]}")
        return
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        if file.name != "value_head.safetensors":
            state.update(load_file(file))
    result = model.load_state_dict(state, strict=False)
    own = model.state_dict()
    loaded = {own[k].data_ptr() for k in state if k in own}
    missing = [k for k in result.missing_keys if own[k].data_ptr() not in loaded]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"{folder}: weights do not match the model (missing {missing[:5]}, unexpected {result.unexpected_keys[:5]})"
        )

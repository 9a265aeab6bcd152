"""The training engine under accelerate — plain/DDP or DeepSpeed ZeRO — and everything the trainers do
differently under it, in one place: building the accelerator, the batch sizes and clipping handed to the
engine, the micro-batch backward and the optimizer step with the non-finite guard, frozen roles, and
full parameters for generation.

DeepSpeed is chosen the way accelerate chooses it: ``accelerate launch --config_file
examples/accelerate/zero2.yaml`` (or ``zero3.yaml``), which sets ``ACCELERATE_USE_DEEPSPEED=true`` and
the ``ACCELERATE_DEEPSPEED_*`` variables. What differs from DDP, and why:

- **Batch sizes** are posttrain's: ``train_micro_batch_size_per_gpu`` = the micro-batch, and
  ``gradient_accumulation_steps`` = micro-batches per process per optimizer step, written into the
  plugin's config before ``prepare`` (accelerate fills ``auto`` only from a DataLoader, which the
  trainers do not hand it). ``gradient_clipping`` = ``optim.max_grad_norm``.
- **Accumulation** is the engine's own: each micro-batch's backward tells the engine whether it is the
  last of the step (``set_gradient_accumulation_boundary``), so ZeRO-2/3 reduce-scatter the gradients
  and step once per optimizer step. DDP's ``no_sync`` does not exist under ZeRO-2/3. The loss is not
  divided by the accumulation count (``scale_wrt_gas=False``): the loop already back-propagates each
  micro-batch's share of the step's global mean (``loop.backward_share``, docs/pitfalls.md #1).
- **Clipping and the step** happen inside ``engine.step()``. ZeRO computes the global gradient norm and
  skips the update itself when it is not finite (parameters, optimizer state unchanged, gradients
  cleared). A non-finite *loss* is turned into a NaN gradient (the micro-batch's backward is scaled by
  NaN), so ZeRO skips that update too; the guard then counts it exactly as without DeepSpeed.
- **Frozen roles** (reference, reward model) under ZeRO-3 become DeepSpeed inference engines of stage 3
  (sharded, gathered layer by layer in each forward, as TRL's ``prepare_deepspeed``); under ZeRO-2 they
  stay one full copy per process.
- **Generation** from a ZeRO-3 policy runs inside ``full_parameters``: every parameter gathered for the
  whole rollout (``deepspeed.zero.GatheredParameters``), released after.

On a machine without a GPU DeepSpeed runs on its CPU accelerator (``DS_ACCELERATOR=cpu``, set here when
unset) over gloo (DeepSpeed uses oneCCL only when its bindings are installed). accelerate enables
DeepSpeed only with ``cpu=False``, so the accelerator is built with ``cpu=False`` and the gloo backend.
"""

from __future__ import annotations

import contextlib
import math
import os
from copy import deepcopy
from dataclasses import replace

import torch

from posttrain.models import ModelConfig, Reference, load_causal_lm, load_policy
from posttrain.models.roles import is_peft_model
from posttrain.trainers.config import RunConfig


def deepspeed_requested() -> bool:
    """``accelerate launch`` with a DeepSpeed config (or ``ACCELERATE_USE_DEEPSPEED=true`` under torchrun)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def build_accelerator(run: RunConfig):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    common = {"mixed_precision": run.mixed_precision, "step_scheduler_with_optimizer": False}
    if torch.cuda.is_available():
        return Accelerator(**common)
    if deepspeed_requested():
        if int(os.environ.get("LOCAL_RANK", -1)) == -1:
            raise RuntimeError(
                "DeepSpeed (ACCELERATE_USE_DEEPSPEED=true) needs a launcher: `accelerate launch --config_file "
                "examples/accelerate/zero2.yaml -m posttrain.cli ...` or torchrun"
            )
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # accelerate only turns DeepSpeed on with cpu=False; DeepSpeed's CPU accelerator speaks gloo here
        return Accelerator(**common, cpu=False, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    # cpu=True on a machine without a GPU is what lets accelerate run several CPU processes (gloo) under torchrun
    return Accelerator(**common, cpu=True)


def is_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def zero_stage(accelerator) -> int | None:
    """The ZeRO stage under DeepSpeed, None otherwise."""
    if not is_deepspeed(accelerator):
        return None
    return int(accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage"])


def describe(accelerator) -> str:
    """One line for the start of a run: which engine, how many processes."""
    stage = zero_stage(accelerator)
    kind = str(accelerator.distributed_type).split(".")[-1]
    kind = {"NO": "plain", "MULTI_CPU": "DDP", "MULTI_GPU": "DDP"}.get(kind, kind)
    kind = f"DeepSpeed ZeRO-{stage}" if stage is not None else kind
    return f"{kind}, {accelerator.num_processes} process(es) on {accelerator.device.type}"


def configure(accelerator, micro_batch_size: int, accumulation: int, max_grad_norm: float | None) -> None:
    """Before ``prepare``: hand the engine posttrain's batch sizes and clipping (a no-op without DeepSpeed).

    ``accumulation``: micro-batches per process per optimizer step. A value the accelerate config sets
    explicitly and differently is refused, naming the posttrain field that decides it.
    """
    if not is_deepspeed(accelerator):
        return
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    wanted = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro_batch_size * accumulation * accelerator.num_processes,
        "gradient_clipping": 0.0 if max_grad_norm is None else float(max_grad_norm),
    }
    decided_by = {
        "train_micro_batch_size_per_gpu": "run.micro_batch_size",
        "gradient_accumulation_steps": "run.batch_size / (processes × run.micro_batch_size)",
        "train_batch_size": "run.batch_size",
        "gradient_clipping": "optim.max_grad_norm",
    }
    for key, value in wanted.items():
        given = config.get(key, "auto")
        # accelerate writes gradient_accumulation_steps=1 when the config leaves it out: 1 means unset
        unset = given == "auto" or (key == "gradient_accumulation_steps" and given == 1)
        if not unset and float(given) != float(value):
            raise ValueError(
                f"the DeepSpeed config sets {key}={given}, but posttrain needs {value} here ({decided_by[key]}): "
                f"leave {key} out of the accelerate/DeepSpeed config, posttrain sets it"
            )
        config[key] = value
    zero = config.setdefault("zero_optimization", {})
    # save_checkpoint / save_final write hf/<role> from the full state dict: gathered from the shards
    zero["stage3_gather_16bit_weights_on_model_save"] = True
    accelerator.gradient_accumulation_steps = accumulation


@contextlib.contextmanager
def micro_batch(accelerator, model, last: bool):
    """Around one micro-batch's forward and backward: gradients are synchronised only on the ``last``
    micro-batch of the optimizer step (DDP: ``no_sync`` before it; DeepSpeed: the accumulation boundary)."""
    if is_deepspeed(accelerator):
        model.set_gradient_accumulation_boundary(last)
        yield
    elif last:
        yield
    else:
        with accelerator.no_sync(model):
            yield


def backward(accelerator, model, loss: torch.Tensor) -> None:
    """Back-propagate ``loss`` as given (already the micro-batch's share of the step's mean).

    Under DeepSpeed a non-finite loss is back-propagated times NaN: its gradient, and so the step's
    global gradient norm, is NaN and ZeRO skips the update (see the module docstring). No host sync."""
    if not is_deepspeed(accelerator):
        accelerator.backward(loss)
        return
    poison = torch.where(torch.isfinite(loss.detach()), 1.0, math.nan)
    model.backward(loss * poison, scale_wrt_gas=False)


def deepspeed_step(accelerator, model, scheduler, guard, step: int, loss: float) -> float:
    """``loop.optimizer_step`` under DeepSpeed: the engine clips (``gradient_clipping``), steps and clears
    the gradients, or skips a non-finite update itself; the guard counts the skip and the schedule waits.
    Returns the gradient norm before clipping (NaN for a skipped update)."""
    model.step()
    applied = model.was_step_applied()
    norm = model.get_global_grad_norm()  # None when the DeepSpeed config turns its computation off
    norm = math.nan if not applied else 0.0 if norm is None else float(norm)
    fp16 = accelerator.state.deepspeed_plugin.deepspeed_config.get("fp16", {}).get("enabled") is True
    # fp16: the loss scaler skips overflowing steps by design (and lowers its scale): only a non-finite loss counts
    allowed = guard.allows(step, loss=loss, grad_norm=0.0 if fp16 else norm)
    if allowed and applied:
        scheduler.step()
    return norm


def prepare_frozen(accelerator, model: torch.nn.Module, device: str | None = None) -> torch.nn.Module:
    """A frozen role (reference policy, reward model) ready for forwards on this process.

    ZeRO-3: a DeepSpeed inference engine of stage 3, its parameters sharded over the processes and
    gathered layer by layer in each forward (TRL's ``prepare_deepspeed``): 2N/d bytes per process instead
    of 2N. Every process must then run the same number of forwards. Otherwise: the model on ``device``
    (default this process's device): one full copy per process; under ZeRO-2 only trained states are
    sharded. A ``device`` (an offload to the CPU) is refused under ZeRO-3, which shards the role instead.
    """
    if zero_stage(accelerator) != 3:
        return model.to(device or accelerator.device)
    if device is not None:
        raise ValueError(
            f"a frozen role placed on {device!r}: under DeepSpeed ZeRO-3 the frozen roles are sharded over the "
            "processes instead; leave reference_device / reward_device unset (offload_param_device in the "
            "DeepSpeed config offloads the shards)"
        )
    import deepspeed

    plugin = accelerator.state.deepspeed_plugin
    config = {
        k: deepcopy(v)
        for k, v in plugin.deepspeed_config.items()
        if k in ("fp16", "bf16", "zero_optimization", "steps_per_print")
    }
    # no optimizer: the batch sizes only need to be consistent for DeepSpeed's config check
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    config["train_batch_size"] = accelerator.num_processes
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if hidden is not None:  # the bucket sizes TRL and accelerate derive from the hidden size
        config["zero_optimization"].update(
            reduce_bucket_size=hidden * hidden,
            stage3_param_persistence_threshold=10 * hidden,
            stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
        )
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def build_reference(
    accelerator, policy, model: ModelConfig, share: str, path: str | None = None, device: str | None = None
) -> Reference:
    """The frozen reference policy π_ref, placed for the engine (``prepare_frozen``).

    ``path``: a separate reference checkpoint; else the starting policy: shared weights with the adapter
    off (``share``, ``Reference.from_policy``) or a frozen copy. Under ZeRO-3 the policy may already be
    sharded when it is loaded (zero.Init), and a deep copy would copy shards, not weights: the copy is
    the starting checkpoint loaded again (as TRL loads its reference under ZeRO-3)."""
    load_device = device or str(accelerator.device)
    if path:
        reference = Reference(model=load_causal_lm(replace(model, path=path, lora=None, device=load_device)))
    elif zero_stage(accelerator) == 3 and not (is_peft_model(policy) and share != "copy"):
        reference = Reference(model=load_policy(replace(model, device=load_device)))
    else:
        reference = Reference.from_policy(policy, share=share)
    if reference.model is not None:
        reference.model = prepare_frozen(accelerator, reference.model, device)
    return reference


@contextlib.contextmanager
def full_parameters(accelerator, model):
    """Every parameter of the prepared ``model`` whole on this process for the duration (one rollout's
    generation from a ZeRO-3 policy), released after; other engines hold them whole already. Yields the
    module to call.

    ZeRO-3: DeepSpeed's own ``unwrap_model_for_generation`` gathers the shards once and takes the
    engine's forward hooks off meanwhile (they would release each layer after its forward and gather it
    again for every generated token), then puts them back."""
    if zero_stage(accelerator) != 3:
        yield accelerator.unwrap_model(model)
        return
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

    with unwrap_model_for_generation(model):
        yield accelerator.unwrap_model(model)

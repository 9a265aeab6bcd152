"""The training engine under accelerate — plain/DDP, DeepSpeed ZeRO or FSDP2 — and everything the trainers do
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

FSDP2 (torch's ``fully_shard``) is chosen the same way: ``accelerate launch --config_file
examples/accelerate/fsdp2.yaml`` sets ``ACCELERATE_USE_FSDP=true``, ``FSDP_VERSION=2`` and the
``FSDP_*`` variables, and accelerate's own FSDP2 code prepares, clips and saves. What differs from DDP:

- **Accumulation**: FSDP2 reduce-scatters the gradients after every micro-batch's backward and
  accumulates the local shards (no ``no_sync``: an unsynchronised FSDP2 backward keeps a full, unsharded
  gradient on every process, the memory FSDP is there to save). The sum is the same.
- **Clipping**: ``accelerator.clip_grad_norm_`` returns the global norm as a DTensor; ``grad_norm``
  turns it into the full value (every process the same), which the non-finite guard reads.
- **Frozen roles** are ``fully_shard``-ed like the policy (without an optimizer): each process holds
  1/world of them, gathered layer by layer in each forward.
- **Every forward is a collective**: processes run the same number of forwards (``evaluate_offline``),
  and generation runs inside ``full_parameters``, which unshards the whole policy once for the rollout
  (no collective per token: processes generating different lengths cannot deadlock) and reshards after.
- **PPO's separate critic** is a second ``prepare`` call: accelerate's FSDP2 refuses two models in one
  call, not two calls; both are sharded with the one plugin.

accelerate 1.15 turns FSDP on only for GPU-type devices (``AcceleratorState``: the FSDP branch sits in
the MULTI_GPU/XPU/... case); on CPU an FSDP request silently becomes DDP. torch's FSDP2 itself runs on
CPU over gloo, so on a machine without an accelerator ``build_accelerator`` builds the FSDP2 plugin
from the launcher's variables and switches accelerate's state to FSDP (printed). FSDP1 is refused.
"""

from __future__ import annotations

import contextlib
import math
import os
from copy import deepcopy
from dataclasses import replace

import torch

from posttrain.errors import UserError
from posttrain.models import ModelConfig, Reference, load_causal_lm, load_policy
from posttrain.models.roles import is_peft_model
from posttrain.runtime.config import RunConfig


def deepspeed_requested() -> bool:
    """``accelerate launch`` with a DeepSpeed config (or ``ACCELERATE_USE_DEEPSPEED=true`` under torchrun)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def fsdp_requested() -> bool:
    """``accelerate launch`` with an FSDP config (or ``ACCELERATE_USE_FSDP=true`` under torchrun)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def _fsdp_plugin():
    """accelerate's FSDP plugin as the launcher's variables describe it (its ``__post_init__`` reads
    ``FSDP_*``); FSDP1 is refused."""
    from accelerate.utils import FullyShardedDataParallelPlugin, str_to_bool

    if not any(key.startswith("FSDP_") for key in os.environ):  # accelerate launch sets them from its config
        raise UserError(
            "ACCELERATE_USE_FSDP=true without an accelerate FSDP config (none of the FSDP_* settings `accelerate "
            "launch` sets from it): launch with `accelerate launch --config_file examples/accelerate/fsdp2.yaml -m "
            "posttrain.cli ...`, or unset ACCELERATE_USE_FSDP to train without FSDP"
        )
    if str_to_bool(os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")):
        # transformers then loads real weights on local rank 0 only: the models posttrain uses before
        # prepare (the shared-prefix probe, DPO's precomputed reference, the reference copy) would differ
        raise UserError(
            "fsdp_cpu_ram_efficient_loading: true loads the weights on one process only, but posttrain runs its "
            "models before sharding them (shared-prefix probe, reference copy): set it to false"
        )
    version = os.environ.get("FSDP_VERSION", "1")  # accelerate's default is FSDP1
    if version != "2":  # checked before the plugin is built: FSDP1's plugin needs an accelerator device
        raise UserError(
            f"FSDP version {version} requested: posttrain supports FSDP2 (torch fully_shard) only; "
            "set fsdp_version: 2 in the accelerate config (examples/accelerate/fsdp2.yaml)"
        )
    return FullyShardedDataParallelPlugin()


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit (HEAP_MAX_SIZE / 2)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEEP_MMAP_THRESHOLD = 32 << 20
KEEP_TRIM_THRESHOLD = 1 << 30


def _glibc():
    """This process's C library when it is glibc (ctypes), else None (macOS, musl, Windows)."""
    import ctypes

    try:
        return ctypes.CDLL(None) if os.confstr("CS_GNU_LIBC_VERSION") else None
    except (ValueError, OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Keep freed CPU memory in this process's heap, for glibc's malloc (``run.keep_freed_memory``).

    glibc serves a block larger than its mmap threshold (128 KiB, raised as such blocks are freed, at
    most to 32 MiB) with a fresh ``mmap`` and unmaps it when freed, and gives the heap's top back to the
    OS when more than the trim threshold is free there. A training step frees and reallocates the same
    activation-sized tensors every step, so the OS hands them back as new zero-filled pages: page faults
    at every step, nearly none with the thresholds fixed at 32 MiB (mmap) and 1 GiB (trim)
    (bench/README.md counts them). Peak RSS stays: the heap holds no more than the step's own peak.
    Fixing the thresholds also turns glibc's dynamic adjustment off. Process-wide, for the rest of the
    process, and idempotent. The cost: memory freed after a peak (up to the trim threshold) stays with
    the process until it reuses it, or until the run ends (``release_freed_memory``).

    Returns whether it applied: False without glibc (macOS, musl), and when the user has set glibc's
    malloc options themselves (``MALLOC_*_`` or ``GLIBC_TUNABLES=glibc.malloc.*``) or preloaded
    another allocator (jemalloc, tcmalloc, mimalloc): theirs win."""
    env = os.environ
    if (
        any(k.startswith("MALLOC_") and k.endswith("_") for k in env)
        or "glibc.malloc." in env.get("GLIBC_TUNABLES", "")
        or any(name in env.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc"))
    ):
        return False
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD)
    )


def release_freed_memory() -> None:
    """Hand the free memory of the heap back to the OS (glibc's ``malloc_trim(0)``): at the end of a
    run, so that a process that goes on (a notebook, a script that trains twice) does not keep what
    ``keep_freed_memory`` held for the next step. Nothing without glibc."""
    libc = _glibc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def build_accelerator(run: RunConfig):
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    if run.keep_freed_memory:
        keep_freed_memory()
    common = {"mixed_precision": run.mixed_precision, "step_scheduler_with_optimizer": False}
    if fsdp_requested():
        plugin = _fsdp_plugin()
        if torch.cuda.is_available():  # accelerate's own path
            return Accelerator(**common, fsdp_plugin=plugin)
        if int(os.environ.get("LOCAL_RANK", -1)) == -1:
            raise UserError(
                "FSDP (ACCELERATE_USE_FSDP=true) needs a launcher: `accelerate launch --config_file "
                "examples/accelerate/fsdp2.yaml -m posttrain.cli ...` or torchrun"
            )
        accelerator = Accelerator(**common, cpu=True)
        # accelerate gates FSDP to accelerator devices and made this DDP; torch's FSDP2 runs on CPU over gloo
        if run.mixed_precision != "no":
            plugin.set_mixed_precision(run.mixed_precision)
        accelerator.state.fsdp_plugin = plugin
        # PartialState too, as AcceleratorState.__init__ itself does at its end: every later AcceleratorState()
        # (AcceleratedOptimizer makes one in prepare) copies PartialState's fields over its own
        PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.print(
            "[engine] FSDP2 on CPU over gloo: accelerate enables FSDP only on accelerator devices (it would run "
            "DDP here), torch's fully_shard supports CPU, so accelerate's state is switched to FSDP"
        )
        return accelerator
    if torch.cuda.is_available():
        return Accelerator(**common)
    if deepspeed_requested():
        if int(os.environ.get("LOCAL_RANK", -1)) == -1:
            raise UserError(
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


def is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def collective_forwards(accelerator) -> bool:
    """Whether every forward of a prepared model is a collective (ZeRO-3, FSDP2): every process must then
    run the same number of forwards."""
    return zero_stage(accelerator) == 3 or is_fsdp(accelerator)


def zero_stage(accelerator) -> int | None:
    """The ZeRO stage under DeepSpeed, None otherwise."""
    if not is_deepspeed(accelerator):
        return None
    return int(accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage"])


def describe(accelerator) -> str:
    """One line for the start of a run: which engine, how many processes, and the mixed precision
    (accelerate's autocast; on a CPU bf16 runs through torch's CPU autocast) when there is one."""
    stage = zero_stage(accelerator)
    kind = str(accelerator.distributed_type).split(".")[-1]
    kind = {"NO": "plain", "MULTI_CPU": "DDP", "MULTI_GPU": "DDP"}.get(kind, kind)
    kind = f"DeepSpeed ZeRO-{stage}" if stage is not None else kind
    kind = f"FSDP{accelerator.state.fsdp_plugin.fsdp_version}" if is_fsdp(accelerator) else kind
    line = f"{kind}, {accelerator.num_processes} process(es) on {accelerator.device.type}"
    precision = str(accelerator.mixed_precision)
    return line if precision in ("no", "None") else f"{line}, {precision} mixed precision"


def configure(accelerator, micro_batch_size: int, accumulation: int, max_grad_norm: float | None) -> None:
    """Before ``prepare``: hand the engine posttrain's batch sizes and clipping (a no-op without DeepSpeed).

    ``accumulation``: micro-batches per process per optimizer step. A value the accelerate config sets
    explicitly and differently is refused, naming the posttrain field that decides it.
    """
    if not is_deepspeed(accelerator):
        return
    plugin = accelerator.state.deepspeed_plugin
    config = plugin.deepspeed_config
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
    # the plugin outlives a run (accelerate's state is shared in the process): what an earlier run in this
    # process wrote is not the user's
    written = getattr(plugin, "posttrain_written", {})
    for key, value in wanted.items():
        given = config.get(key, "auto")
        # accelerate writes gradient_accumulation_steps=1 when the config leaves it out: 1 means unset
        unset = given == "auto" or (key == "gradient_accumulation_steps" and given == 1) or written.get(key) == given
        if not unset and float(given) != float(value):
            raise UserError(
                f"the DeepSpeed config sets {key}={given}, but posttrain needs {value} here ({decided_by[key]}): "
                f"leave {key} out of the accelerate/DeepSpeed config, posttrain sets it"
            )
        config[key] = value
    plugin.posttrain_written = wanted
    zero = config.setdefault("zero_optimization", {})
    # save_checkpoint / save_final write hf/<role> from the full state dict: gathered from the shards
    zero["stage3_gather_16bit_weights_on_model_save"] = True
    accelerator.gradient_accumulation_steps = accumulation


@contextlib.contextmanager
def micro_batch(accelerator, model, last: bool):
    """Around one micro-batch's forward and backward: gradients are synchronised only on the ``last``
    micro-batch of the optimizer step (DDP: ``no_sync`` before it; DeepSpeed: the accumulation boundary),
    except under FSDP2, which reduce-scatters every micro-batch's gradient (module docstring)."""
    if is_deepspeed(accelerator):
        model.set_gradient_accumulation_boundary(last)
        yield
    elif last or is_fsdp(accelerator):  # FSDP2: reduce-scatter every micro-batch (module docstring)
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


def prepare(accelerator, model: torch.nn.Module, optimizer):
    """``accelerator.prepare(model, optimizer)``. Under FSDP2 the layers to shard one by one are the
    transformer blocks (``_no_split_modules``) of the Hugging Face model inside ``model`` when the
    accelerate config names none (a wrapper — reward scorer, value model, policy with a value head — has
    no ``_no_split_modules`` of its own), and the root unit is fixed (``_fsdp_root``)."""
    if not is_fsdp(accelerator):
        return accelerator.prepare(model, optimizer)
    with _fsdp_units(accelerator, model, frozen=False):
        model, optimizer = accelerator.prepare(model, optimizer)
    return _fsdp_root(model), optimizer


def _fsdp_root(model: torch.nn.Module) -> torch.nn.Module:
    """Make the outermost FSDP unit of a sharded ``model`` the root now. torch decides the root at the
    first forward, and a first forward through an inner module (the shared-prefix probe runs the backbone;
    a rollout the Hugging Face model inside a wrapper) would make an inner unit the root."""
    model._get_fsdp_state()._lazy_init()
    return model


@contextlib.contextmanager
def _fsdp_units(accelerator, model: torch.nn.Module, frozen: bool):
    """Around accelerate sharding ``model``: the transformer blocks to shard one by one (``prepare``), and
    for a ``frozen`` role each ``score`` head (a reward model's) as a unit of its own: ``models.roles``
    calls the head directly, outside the model's forward, where the root unit's parameters stay sharded
    (a trained critic runs it inside its wrapper's forward). The block classes are this model's when the
    accelerate config names none, and unset again after: the one plugin serves every role, and a reward
    model or critic of another architecture than the policy has other block classes."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    plugin = accelerator.state.fsdp_plugin
    named = plugin.transformer_cls_names_to_wrap
    if named is None:
        inner = next((m for m in model.modules() if getattr(m, "_no_split_modules", None)), None)
        if inner is not None:
            plugin.transformer_cls_names_to_wrap = list(inner._no_split_modules)
    heads = [m for name, m in model.named_modules() if frozen and name.split(".")[-1] == "score"]
    for head in heads:
        if not isinstance(head, FSDPModule):
            mp = plugin.mixed_precision_policy or MixedPrecisionPolicy()
            fully_shard(head, reshard_after_forward=False, offload_policy=plugin.cpu_offload, mp_policy=mp)
    try:
        yield
    finally:
        plugin.transformer_cls_names_to_wrap = named


def grad_norm(accelerator, params: list, max_norm: float | None) -> float:
    """The global gradient norm of ``params`` (every process the same), clipped to ``max_norm`` when given.

    FSDP2: the gradients are shards (DTensors); accelerate's ``clip_grad_norm_`` (max_norm = inf when
    unclipped: a factor of exactly 1) returns the norm as a DTensor, made whole here."""
    if max_norm is None and not is_fsdp(accelerator):
        norms = [p.grad.detach().norm() for p in params if p.grad is not None]
        return float(torch.stack(norms).norm()) if norms else 0.0
    norm = accelerator.clip_grad_norm_(params, math.inf if max_norm is None else max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor
        norm = norm.full_tensor()
    return float(norm)


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
    FSDP2: ``fully_shard`` as accelerate shards the policy, without an optimizer (1/world per process,
    gathered layer by layer in each forward; every process must run the same number of forwards).
    """
    if is_fsdp(accelerator):
        if device is not None:
            raise UserError(
                f"a frozen role placed on {device!r}: under FSDP2 the frozen roles are sharded over the processes "
                "instead; leave reference_device / reward_device unset (fsdp_offload_params offloads the shards)"
            )
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        with _fsdp_units(accelerator, model, frozen=True):
            sharded = fsdp2_prepare_model(accelerator, model.requires_grad_(False)).eval()
        return _fsdp_root(sharded)
    if zero_stage(accelerator) != 3:
        return model.to(device or accelerator.device)
    if device is not None:
        raise UserError(
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
    generation from a ZeRO-3 or FSDP2 policy), released after; DDP and ZeRO-2 hold them whole already.
    Yields the module to call.

    ZeRO-3: DeepSpeed's own ``unwrap_model_for_generation`` gathers the shards once and takes the
    engine's forward hooks off meanwhile (they would release each layer after its forward and gather it
    again for every generated token), then puts them back.

    FSDP2: every FSDP unit of ``model`` is unsharded (one all-gather each) with resharding after forward
    off, so the generation's forwards communicate nothing and processes may generate different numbers
    of tokens; after, every unit is resharded and its resharding setting restored."""
    if is_fsdp(accelerator):
        with _fsdp_unsharded(model):
            yield accelerator.unwrap_model(model)
        return
    if zero_stage(accelerator) != 3:
        yield accelerator.unwrap_model(model)
        return
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

    with unwrap_model_for_generation(model):
        yield accelerator.unwrap_model(model)


@contextlib.contextmanager
def _fsdp_unsharded(model):
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]  # the root first
    if not units:
        yield
        return
    _fsdp_root(units[0])  # the rollout may call an inner module first (the policy in a shared-critic policy)
    states = [m._get_fsdp_state() for m in units]
    automatic = [state._auto_reshard_after_forward for state in states]
    groups = [g for state in states for g in state._fsdp_param_groups]
    resharding = [g.post_forward_mesh_info for g in groups]
    try:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        yield
    finally:
        for unit in units:
            unit.reshard()
        for state, auto in zip(states, automatic, strict=True):
            state._auto_reshard_after_forward = auto
        for group, mesh_info in zip(groups, resharding, strict=True):
            group.post_forward_mesh_info = mesh_info

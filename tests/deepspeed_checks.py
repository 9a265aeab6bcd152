"""Checks of posttrain/runtime/engines.py inside a real DeepSpeed run (tests/test_deepspeed.py launches it
on two processes with ``accelerate launch --config_file examples/accelerate/zero{2,3}.yaml``).

Prints one JSON line from the main process: {check: value}.
"""

from __future__ import annotations

import json
import math
import sys

import torch

from posttrain.runtime import engines
from posttrain.runtime.config import OptimConfig, RunConfig
from posttrain.runtime.loop import NonFiniteGuard, build_optimizer


def _weights(accelerator, model) -> dict[str, torch.Tensor]:
    with engines.full_parameters(accelerator, model) as module:
        return {k: v.detach().clone() for k, v in module.named_parameters()}


def non_finite_loss(accelerator, out: dict) -> None:
    """A non-finite loss whose gradient is finite (zero) is still skipped: the engine sees a NaN norm."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer, scheduler = build_optimizer(model.parameters(), OptimConfig(lr=1e-2), total_steps=10)
    engines.configure(accelerator, micro_batch_size=4, accumulation=1, max_grad_norm=1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    guard = NonFiniteGuard(accelerator, RunConfig(max_nonfinite_steps=5))
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(accelerator.process_index))

    def update(step: int, make_loss) -> float:
        with engines.micro_batch(accelerator, model, last=True):
            loss = make_loss(model(x))
            engines.backward(accelerator, model, loss)
        loss = float(accelerator.reduce(loss.detach(), reduction="mean"))
        return engines.deepspeed_step(accelerator, model, scheduler, guard, step, loss)

    update(1, lambda y: y.square().mean())  # a normal update: Adam now has momentum
    before, lr_steps = _weights(accelerator, model), scheduler.last_epoch
    norm = update(2, lambda y: y.sum() * 0 + math.inf)  # loss inf, gradient exactly 0
    after = _weights(accelerator, model)
    out["inf_loss_norm"] = norm
    out["inf_loss_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["inf_loss_skips"] = guard.skips
    out["inf_loss_schedule_waited"] = scheduler.last_epoch == lr_steps
    # the same zero gradient with a finite loss does move the parameters (Adam's momentum): what the skip prevented
    update(3, lambda y: y.sum() * 0)
    moved = _weights(accelerator, model)
    out["zero_grad_moves"] = any(not torch.equal(after[k], moved[k]) for k in after)
    out["zero_grad_skips"] = guard.skips


def conflicting_config_is_refused(accelerator, out: dict) -> None:
    """A DeepSpeed config that sets what posttrain decides (here gradient_clipping 0.5 against
    optim.max_grad_norm 1.0) is refused, naming the posttrain field."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    saved = config.get("gradient_clipping", "auto")
    config["gradient_clipping"] = 0.5
    try:
        engines.configure(accelerator, micro_batch_size=4, accumulation=1, max_grad_norm=1.0)
        out["conflict"] = None
    except ValueError as error:
        out["conflict"] = str(error)
    config["gradient_clipping"] = saved


def frozen_is_sharded(accelerator, out: dict) -> None:
    """``prepare_frozen``: under ZeRO-3 each process holds 1/world of the frozen model, and its forward
    equals the unsharded model's."""
    torch.manual_seed(1)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).requires_grad_(False)
    x = torch.randn(3, 16)
    expected = plain(x)
    frozen = engines.prepare_frozen(accelerator, plain)
    module = accelerator.unwrap_model(frozen) if frozen is not plain else plain
    total = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in module.parameters())
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in module.parameters())
    with torch.no_grad():
        got = frozen(x)
    out["frozen_local_share"] = local / total
    out["frozen_forward_diff"] = float((got - expected).abs().max())


if __name__ == "__main__":
    torch.set_num_threads(1)
    accelerator = engines.build_accelerator(RunConfig())
    results = {"engine": engines.describe(accelerator), "processes": accelerator.num_processes}
    frozen_is_sharded(accelerator, results)
    conflicting_config_is_refused(accelerator, results)
    non_finite_loss(accelerator, results)
    if accelerator.is_main_process:
        print(json.dumps(results), flush=True)
    from posttrain.cli import _end_distributed

    _end_distributed()
    sys.exit(0)

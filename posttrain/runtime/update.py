"""The pieces of an online trainer's update, for its ``update`` method to drive in the open (forward →
per-token loss → aggregation → backward → step, in CleanRL's and nanochat's order): ``MinibatchUpdate`` (a
minibatch's micro-batches with their backward shares, one optimizer step) and ``StepStats`` (the step's
statistics, kept on the device and reduced over the processes together at the end of the step: one collective
and one host sync for all of them, not one per statistic, micro-batch or minibatch).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.core import aggregation_units
from posttrain.runtime import engines
from posttrain.runtime.loop import NonFiniteGuard, global_sums, loss_share, optimizer_step


@dataclass
class Optimized:
    """A trained model as accelerate prepared it, with its optimizer, schedule and non-finite guard."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    guard: NonFiniteGuard
    max_grad_norm: float | None


def micro_slices(n: int, size: int) -> list[slice]:
    """Consecutive slices of ``size`` of ``n`` rows, the last one shorter when ``size`` does not divide ``n``."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@dataclass(frozen=True)
class MicroBatch:
    """Rows of a minibatch that go through one forward and backward together."""

    rows: slice
    share: float
    """The factor of the micro-batch's loss (reduced by ``loss_agg`` over its rows) in the minibatch's mean over
    every process: its loss units × processes / the minibatch's units over every process (``loop.loss_share``)."""
    empty: bool
    """No token of its rows trains (GRPO: a group no reward function scored): its statistics (a ratio of 0 over no
    token) are not counted."""


class MinibatchUpdate:
    """One optimizer step of ``trained`` on a minibatch whose response mask is ``mask`` [b, T], driven micro-batch
    by micro-batch from a trainer's ``update``, so that forward, loss, backward and step read in a row there:

        update = MinibatchUpdate(accelerator, trained, mask, loss_agg, micro_batch_size)
        for micro in update:                      # gradients synchronised on the last micro-batch only
            loss, stats = ...                     # forward of rows micro.rows; their loss reduced by loss_agg
            update.backward(micro, loss, stats)   # ∇(loss · micro.share): the minibatch's mean over every process
        grad_norm = update.step(step)             # clip, optimizer step; the non-finite guard reads the loss

    ``empty``: no token of the minibatch trains on any process; it yields no micro-batch and must not be stepped
    (Adam's momentum would still move the weights on a zero gradient). Its loss units are counted and reduced over
    the processes once, before the first forward. The loss statistics stay on the device (``tally``), weighted by
    the shares, until ``StepStats.result`` reduces the step's together.
    """

    def __init__(self, accelerator, trained: Optimized, mask: torch.Tensor, loss_agg: str, micro_batch_size: int):
        self.accelerator, self.trained = accelerator, trained
        slices = micro_slices(len(mask), micro_batch_size)
        # per micro-batch (tokens that train, loss units): read to the host once, summed over processes once
        parts = [
            torch.stack([mask[s].bool().sum().double(), aggregation_units(mask[s], loss_agg).double()]) for s in slices
        ]
        local = torch.stack(parts).tolist() if parts else []
        tokens, units = global_sums(accelerator, sum(t for t, _ in local), sum(u for _, u in local))
        self.empty = tokens == 0
        self.micro_batches = [
            MicroBatch(s, loss_share(accelerator, u, units), t == 0) for s, (t, u) in zip(slices, local, strict=True)
        ]
        self.loss: torch.Tensor | float = 0.0  # Σ loss · share, this process's part of the minibatch's loss
        self.tally = Tally()

    def __iter__(self) -> Iterator[MicroBatch]:
        last = len(self.micro_batches) - 1
        for k, micro in enumerate([] if self.empty else self.micro_batches):
            with engines.micro_batch(self.accelerator, self.trained.model, last=k == last):
                yield micro

    def backward(self, micro: MicroBatch, loss: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        """Back-propagate ``loss`` times its share and tally ``stats`` (detached scalars) weighted by it: means
        over micro-batches and processes, keys ending ``_max`` / ``_min`` extremes."""
        engines.backward(self.accelerator, self.trained.model, loss * micro.share)
        self.loss = self.loss + (loss * micro.share).detach()
        for key, value in stats.items():
            if key.endswith(("_max", "_min")):
                self.tally.add(key, None if micro.empty else value)
            else:
                self.tally.add(key, None if micro.empty else value, micro.share)
                self.tally.add(key + "/weight", 0.0 if micro.empty else micro.share)

    def step(self, step: int) -> float:
        """Clip the gradient norm, step the optimizer and its schedule (``loop.optimizer_step``, which skips a
        non-finite loss or norm). Returns the gradient norm before clipping; NaN, and no step, when ``empty``."""
        acc, trained = self.accelerator, self.trained
        if self.empty:
            return math.nan
        (loss,) = global_sums(acc, self.loss)
        return optimizer_step(
            acc,
            trained.model,
            trained.optimizer,
            trained.scheduler,
            trained.max_grad_norm,
            trained.guard,
            step + 1,
            loss / acc.num_processes,  # the minibatch's loss, for the guard
        )

    def means(self) -> dict[str, float]:
        """The minibatch's statistics, once ``reduce_tallies`` has reduced ``tally``: share-weighted means over
        micro-batches and processes (NaN for one nothing contributed to, not 0), extremes (NaN likewise)."""
        reduced, out = self.tally.reduced, {}
        for key, value in reduced.items():
            if key.endswith(("_max", "_min")):
                out[key] = math.nan if value == _nothing(key) else value
            elif not key.endswith("/weight"):
                weight = reduced[key + "/weight"]
                out[key] = value / weight if weight > 0 else math.nan
        return out


class Tally:
    """Named statistics of one process, kept where they are computed (float64 tensors on the device, or host
    numbers) so that adding them up syncs nothing; ``reduce_tallies`` reduces several over the processes in one
    collective and puts the result in ``reduced``. A key ending ``_max`` / ``_min`` keeps the extreme of its
    values (NaN wins: a NaN ratio must show, not vanish), any other key their sum. Every process must add the
    same keys (in any order)."""

    def __init__(self):
        self.values: dict[str, torch.Tensor | float | None] = {}
        self.reduced: dict[str, float] = {}

    def add(self, key: str, value: torch.Tensor | float | None, weight: float = 1.0) -> None:
        """Add ``value`` (a 0-d tensor or a number; to a sum times ``weight``), or nothing (None: the key is
        kept, so that every process reduces the same keys)."""
        current = self.values.get(key)
        if value is None:
            self.values.setdefault(key, None if key.endswith(("_max", "_min")) else 0.0)
            return
        value = value.detach().double() if isinstance(value, torch.Tensor) else float(value)
        if not key.endswith(("_max", "_min")):
            self.values[key] = (0.0 if current is None else current) + value * weight
        elif current is None:
            self.values[key] = value
        else:  # torch.maximum / minimum: NaN wins
            pick = torch.maximum if key.endswith("_max") else torch.minimum
            device = next((v.device for v in (current, value) if isinstance(v, torch.Tensor)), None)
            self.values[key] = pick(*(torch.as_tensor(v, dtype=torch.float64, device=device) for v in (current, value)))


def reduce_tallies(accelerator, *tallies: Tally) -> None:
    """Reduce every tally over the processes, all in one collective (a gather of their values, stacked) and one
    host sync: sums summed, extremes picked (an extreme nothing was added to reads ∓inf). Fills ``reduced``."""
    keys = [(tally, key) for tally in tallies for key in sorted(tally.values)]
    if not keys:
        return
    device, values = accelerator.device, []
    for tally, key in keys:
        value = tally.values[key]
        values.append(_nothing(key) if value is None else value)
    on_device = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    local = torch.tensor([0.0 if isinstance(v, torch.Tensor) else v for v in values], dtype=torch.float64)
    local = local.to(device)
    if on_device:  # the device's values into their places, in one copy
        index = torch.tensor(on_device, device=device)
        local = local.index_copy(0, index, torch.stack([values[i].to(device).reshape(()) for i in on_device]))
    everyone = accelerator.gather(local).reshape(accelerator.num_processes, len(keys))  # [processes, keys]
    is_max = torch.tensor([key.endswith("_max") for _, key in keys], device=device)
    is_min = torch.tensor([key.endswith("_min") for _, key in keys], device=device)
    picked = torch.where(is_max, everyone.max(0).values, torch.where(is_min, everyone.min(0).values, everyone.sum(0)))
    for (tally, key), value in zip(keys, picked.tolist(), strict=True):
        tally.reduced[key] = value


class StepMetrics:
    """The logged metrics of a step that are sums or extremes over the processes, reduced together, in one
    collective and one host sync, when the step ends (``flush``), not one reduction per metric. A part of the
    step adds its local sums (``add``: a ``Tally``'s keys, so ``_max`` / ``_min`` keys keep extremes) with how
    its metrics follow from their totals; a whole ``Tally`` with its own metrics (``include``); what must wait
    for the metrics (``then``). Only values that are logged belong here: a reduction whose result steers the
    step is made where it is needed. A std comes from Σx, Σx² and n (``std_of``)."""

    def __init__(self):
        self.tally = Tally()
        self.parts: list[tuple[str, list[str], Callable[[dict[str, float]], dict[str, float]]]] = []
        self.tallies: list[tuple[Tally, Callable[[], dict[str, float]]]] = []
        self.callbacks: list[Callable[[dict[str, float]], None]] = []

    def add(self, name: str, finish: Callable[[dict[str, float]], dict[str, float]], **values) -> None:
        """Local ``values`` (numbers or 0-d tensors) under ``name``; at ``flush``, ``finish`` turns their totals
        over every process (a dict by the same keywords) into metrics. Every process adds the same keys."""
        for key, value in values.items():
            self.tally.add(f"{name}.{key}", value)
        self.parts.append((name, [*values], finish))

    def include(self, tally: Tally, finish: Callable[[], dict[str, float]]) -> None:
        """``tally`` reduced in the same collective; then ``finish()`` reads its ``reduced`` into metrics."""
        self.tallies.append((tally, finish))

    def then(self, callback: Callable[[dict[str, float]], None]) -> None:
        """``callback(metrics)`` once ``flush`` has them (a control value needed by the next step only)."""
        self.callbacks.append(callback)

    def flush(self, accelerator) -> dict[str, float]:
        """The step's metrics, reduced over the processes in one collective; the collector is empty after."""
        tally, parts, tallies, callbacks = self.tally, self.parts, self.tallies, self.callbacks
        self.__init__()
        reduce_tallies(accelerator, tally, *(t for t, _ in tallies))
        out: dict[str, float] = {}
        for name, keys, finish in parts:
            out.update(finish({key: tally.reduced[f"{name}.{key}"] for key in keys}))
        for _, finish in tallies:
            out.update(finish())
        for callback in callbacks:
            callback(out)
        return out


def ratio(total: float, count: float) -> float:
    """``total / count``; NaN (nothing to average, not 0) when ``count`` is 0."""
    return total / count if count else math.nan


def std_of(total: float, total_sq: float, count: float) -> float:
    """The unbiased std (``torch.std``'s, n − 1) of ``count`` values from their Σx and Σx²: sqrt((Σx² − (Σx)²/n)
    / (n − 1)), 0 for fewer than two values."""
    if count <= 1:
        return 0.0
    return max((total_sq - total * total / count) / (count - 1), 0.0) ** 0.5


def corr_of(sum_x: float, sum_y: float, sum_xx: float, sum_yy: float, sum_xy: float, count: float) -> float:
    """Pearson's r of ``count`` pairs (x, y) from their sums: (nΣxy − ΣxΣy) / sqrt((nΣx² − (Σx)²)(nΣy² − (Σy)²));
    NaN when x or y is constant (to float rounding) or there are fewer than two pairs: no correlation to speak of."""
    var_x, var_y = count * sum_xx - sum_x * sum_x, count * sum_yy - sum_y * sum_y
    if count < 2 or var_x <= 1e-12 * count * sum_xx or var_y <= 1e-12 * count * sum_yy:
        return math.nan
    return (count * sum_xy - sum_x * sum_y) / math.sqrt(var_x * var_y)


class StepStats:
    """The statistics of a step's updates, reduced over the processes together, in one collective, by
    ``result``: per minibatch (``add``) its updates' share-weighted loss statistics (``MinibatchUpdate.means``)
    and numbers every process holds alike (``grad_norm``); per step the mean of each over the minibatches that
    have it (keys ending ``_max`` / ``_min``: the extreme). ``sums``: other sums of the step (the trainer's)."""

    def __init__(self):
        self.minibatches: list[tuple[tuple[MinibatchUpdate, ...], dict[str, float]]] = []
        self.sums = Tally()
        self.first: dict[str, float] | None = None
        """The first minibatch's statistics, once ``result`` ran."""

    def add(self, *updates: MinibatchUpdate, **numbers: float) -> None:
        """One minibatch: its updates (the policy's; a separate critic's) and ``numbers``."""
        self.minibatches.append((updates, numbers))

    def result(self, accelerator, *others: Tally) -> dict[str, float]:
        """The step's statistics; ``sums`` and ``others`` are reduced in the same collective (read their
        ``reduced``)."""
        reduce_tallies(accelerator, self.sums, *others, *(u.tally for updates, _ in self.minibatches for u in updates))
        parts = [
            {**{k: v for update in updates for k, v in update.means().items()}, **numbers}
            for updates, numbers in self.minibatches
        ]
        self.first = parts[0] if parts else None
        totals, counts = {}, defaultdict(int)
        for part in parts:
            for key, value in part.items():
                counts[key] += 1
                if key.endswith("_max"):
                    totals[key] = _extreme(max, totals.get(key, _nothing(key)), value)
                elif key.endswith("_min"):
                    totals[key] = _extreme(min, totals.get(key, _nothing(key)), value)
                else:
                    totals[key] = totals.get(key, 0.0) + value
        out = {}
        for key, value in totals.items():
            if key.endswith(("_max", "_min")):
                out[key] = math.nan if value == _nothing(key) else value
            else:
                out[key] = value / counts[key]
        return out


def _nothing(key: str) -> float:
    """The extreme of no value: −inf for a key ending ``_max``, +inf for one ending ``_min``."""
    return -math.inf if key.endswith("_max") else math.inf


def _extreme(pick, current: float, value: float) -> float:
    """``pick`` (max or min) of two numbers, NaN when either is: a NaN ratio must show, not vanish."""
    return math.nan if math.isnan(current) or math.isnan(value) else pick(current, value)

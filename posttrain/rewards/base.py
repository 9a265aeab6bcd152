"""The reward-function interface.

A reward function is any Python callable

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

where ``columns`` are the other columns of the prompt rows (``answer``, ``tests``, ...), one value per
completion. ``None`` means "not applicable to this sample" (a math reward on a coding prompt): it is
left out of the weighted sum, never counted as 0. In YAML a reward is named ``module:function`` or
``path/to/file.py:function`` with a weight.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import multiprocessing
import os
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

RewardFunction = Callable[..., list]
ON_ERROR = ("raise", "skip")
ISOLATION = ("process", "inline")
_MIN_SAMPLES_FOR_ABORT = 20  # a failure rate is not judged on fewer samples


class RewardError(RuntimeError):
    """A reward function failed in a way the run must not continue past."""


@dataclass
class RewardSpec:
    """One reward function of a weighted sum."""

    function: str = ""
    """``module:function`` or ``path/to/file.py:function``."""
    weight: float = 1.0
    """Weight in the sum of rewards."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments bound to the function (e.g. a soft length limit)."""
    timeout: float = 60.0
    """Seconds one call may take; a call that hangs is killed and its samples get None (counted)."""
    on_error: str = "raise"
    """A call that raises: raise (stop, showing the traceback and the offending prompt and completion)
    or skip (that sample gets None and is counted)."""
    max_failure_rate: float = 0.1
    """Stop the run when more than this share of the samples scored so far failed or timed out."""
    isolation: str = "process"
    """process: each call runs in a forked worker that is killed on timeout; inline: in a thread of
    this process (for reward models: a hung call is abandoned, not killed)."""

    def validate(self, name: str = "rewards[]") -> None:
        if ":" not in self.function:
            raise ValueError(
                f"{name}.function must look like module:function or path/file.py:function, got {self.function!r}"
            )
        if self.on_error not in ON_ERROR:
            raise ValueError(f"{name}.on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.isolation not in ISOLATION:
            raise ValueError(f"{name}.isolation must be one of {ISOLATION}, got {self.isolation!r}")
        if self.timeout <= 0 or not 0 <= self.max_failure_rate <= 1:
            raise ValueError(f"{name}: timeout must be > 0 and max_failure_rate in [0, 1]")

    @property
    def name(self) -> str:
        return self.function.rsplit(":", 1)[1]


def load_reward_function(spec: str) -> RewardFunction:
    """Import ``module:function`` or ``path/to/file.py:function``."""
    target, _, attribute = spec.rpartition(":")
    if not target or not attribute:
        raise ValueError(f"a reward function is named module:function or path/file.py:function, got {spec!r}")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise FileNotFoundError(f"reward function file not found: {path}")
        module_spec = importlib.util.spec_from_file_location(f"posttrain_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise ValueError(f"{spec}: {attribute!r} is not a callable in {target}")
    return fn


@dataclass
class RewardOutput:
    """Rewards of B completions."""

    total: torch.Tensor  # [B] Σ_i w_i·r_i over the applicable functions; NaN where none applies
    components: dict[str, list[float | None]]  # per function, as it returned them
    faults: dict[str, float] = field(default_factory=dict)  # cumulative failures and timeouts per function

    @property
    def applicable(self) -> torch.Tensor:
        """[B] bool: at least one function scored the sample."""
        return ~torch.isnan(self.total)

    def metrics(self) -> dict[str, float]:
        out = {}
        for name, values in self.components.items():
            scored = [v for v in values if v is not None]
            out[f"reward/{name}/mean"] = sum(scored) / len(scored) if scored else math.nan
            out[f"reward/{name}/applicable"] = len(scored) / max(len(values), 1)
        out.update(self.faults)
        return out


def _child(conn, fn, prompts, completions, columns) -> None:
    try:
        conn.send(("ok", list(fn(prompts, completions, **columns))))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def call_with_timeout(fn, prompts, completions, columns, timeout: float, isolation: str = "process"):
    """("ok", values) | ("error", traceback) | ("timeout", None) of one call of a reward function."""
    if isolation == "inline":
        box: list = []
        thread = threading.Thread(target=lambda: box.append(_inline(fn, prompts, completions, columns)), daemon=True)
        thread.start()
        thread.join(timeout)
        return box[0] if box else ("timeout", None)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # a forked child must not use tokenizer threads
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    worker = context.Process(target=_child, args=(sender, fn, prompts, completions, columns), daemon=True)
    worker.start()
    sender.close()
    try:
        if receiver.poll(timeout):
            return receiver.recv()
        return ("timeout", None)
    except EOFError:  # the worker died without answering (killed, out of memory)
        return ("error", f"the reward worker exited with status {worker.exitcode} without an answer")
    finally:
        worker.kill()
        worker.join()
        receiver.close()


def _inline(fn, prompts, completions, columns):
    try:
        return ("ok", list(fn(prompts, completions, **columns)))
    except BaseException:
        return ("error", traceback.format_exc())


@dataclass
class _Tracked:
    name: str
    fn: RewardFunction
    weight: float
    spec: RewardSpec
    samples: int = 0
    failures: int = 0
    timeouts: int = 0


class RewardComposer:
    """A weighted sum of reward functions, each run under a timeout and each component kept for logging."""

    def __init__(self, functions: list[tuple[str, RewardFunction, float]], specs: list[RewardSpec] | None = None):
        if not functions:
            raise ValueError("at least one reward function is needed")
        specs = specs or [
            RewardSpec(function=f"<callable>:{name}", weight=w, isolation="inline") for name, _, w in functions
        ]
        self.functions = [_Tracked(name, fn, w, spec) for (name, fn, w), spec in zip(functions, specs, strict=True)]

    @classmethod
    def from_specs(cls, specs: list[RewardSpec]) -> RewardComposer:
        functions = []
        for spec in specs:
            fn = load_reward_function(spec.function)
            functions.append((spec.name, partial(fn, **spec.kwargs) if spec.kwargs else fn, spec.weight))
        return cls(functions, specs)

    def _scores(self, tracked: _Tracked, prompts, completions, columns) -> list:
        """One function's values, with failing or hanging samples found one by one and handled."""
        spec, B = tracked.spec, len(completions)
        status, payload = call_with_timeout(tracked.fn, prompts, completions, columns, spec.timeout, spec.isolation)
        if status == "ok":
            values = payload
            if len(values) != B:
                raise RewardError(f"reward function {tracked.name!r} returned {len(values)} values for {B} completions")
        elif status == "timeout" and spec.isolation == "inline":  # an abandoned thread: do not start B more
            values = [None] * B
            tracked.timeouts += B
        else:  # find the samples that fail or hang, one call each
            values = []
            for b in range(B):
                one = {k: [v[b]] for k, v in columns.items()}
                status, payload = call_with_timeout(
                    tracked.fn, [prompts[b]], [completions[b]], one, spec.timeout, spec.isolation
                )
                if status == "ok" and len(payload) == 1:
                    values.append(payload[0])
                    continue
                if status == "timeout":
                    tracked.timeouts += 1
                elif spec.on_error == "raise":
                    raise RewardError(
                        f"reward function {tracked.name!r} raised on a sample (set on_error: skip to score it "
                        f"None and go on)\nprompt: {prompts[b]!r}\ncompletion: {completions[b]!r}\n{payload}"
                    )
                else:
                    tracked.failures += 1
                values.append(None)
        tracked.samples += B
        bad = tracked.failures + tracked.timeouts
        if tracked.samples >= _MIN_SAMPLES_FOR_ABORT and bad > spec.max_failure_rate * tracked.samples:
            raise RewardError(
                f"reward function {tracked.name!r}: {tracked.failures} failures and {tracked.timeouts} timeouts in "
                f"{tracked.samples} samples, over max_failure_rate={spec.max_failure_rate}"
            )
        return values

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> RewardOutput:
        B = len(completions)
        total = torch.zeros(B, dtype=torch.float64)
        scored = torch.zeros(B, dtype=torch.bool)
        components = {}
        for tracked in self.functions:
            values = self._scores(tracked, prompts, completions, columns)
            for b, value in enumerate(values):
                if value is None:
                    continue
                value = float(value)
                if math.isnan(value):
                    raise RewardError(
                        f"reward function {tracked.name!r} returned NaN for completion {b} (prompt {prompts[b]!r}, "
                        f"completion {completions[b]!r}); return None for 'not applicable'"
                    )
                total[b] += tracked.weight * value
                scored[b] = True
            components[tracked.name] = values
        total = torch.where(scored, total, torch.nan).float()
        return RewardOutput(total, components, self.fault_counts())

    def fault_counts(self) -> dict[str, float]:
        out = {}
        for t in self.functions:
            out[f"reward/{t.name}/failures"] = t.failures
            out[f"reward/{t.name}/timeouts"] = t.timeouts
        return out

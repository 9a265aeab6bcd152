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
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

RewardFunction = Callable[..., list]


@dataclass
class RewardSpec:
    """One reward function of a weighted sum."""

    function: str = ""
    """``module:function`` or ``path/to/file.py:function``."""
    weight: float = 1.0
    """Weight in the sum of rewards."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments bound to the function (e.g. a soft length limit)."""

    def validate(self, name: str = "rewards[]") -> None:
        if ":" not in self.function:
            raise ValueError(
                f"{name}.function must look like module:function or path/file.py:function, got {self.function!r}"
            )

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
        return out


class RewardComposer:
    """A weighted sum of reward functions, each component kept for logging."""

    def __init__(self, functions: list[tuple[str, RewardFunction, float]]):
        if not functions:
            raise ValueError("at least one reward function is needed")
        self.functions = functions

    @classmethod
    def from_specs(cls, specs: list[RewardSpec]) -> RewardComposer:
        functions = []
        for spec in specs:
            fn = load_reward_function(spec.function)
            functions.append((spec.name, partial(fn, **spec.kwargs) if spec.kwargs else fn, spec.weight))
        return cls(functions)

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> RewardOutput:
        B = len(completions)
        total = torch.zeros(B, dtype=torch.float64)
        scored = torch.zeros(B, dtype=torch.bool)
        components = {}
        for name, fn, weight in self.functions:
            values = list(fn(prompts, completions, **columns))
            if len(values) != B:
                raise ValueError(f"reward function {name!r} returned {len(values)} values for {B} completions")
            for b, value in enumerate(values):
                if value is None:
                    continue
                value = float(value)
                if math.isnan(value):
                    raise ValueError(
                        f"reward function {name!r} returned NaN for completion {b} (prompt {prompts[b]!r}, "
                        f"completion {completions[b]!r}); return None for 'not applicable'"
                    )
                total[b] += weight * value
                scored[b] = True
            components[name] = values
        total = torch.where(scored, total, torch.nan).float()
        return RewardOutput(total, components)

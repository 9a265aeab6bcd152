"""Which environment ``env.name`` names: the shipped ones (calculator, python, tools) or ``module:Class`` of
your own. Above the environments, which import ``posttrain.envs.base`` and nothing of this module."""

from __future__ import annotations

from posttrain.envs.base import EnvConfig, Environment
from posttrain.envs.calculator import CalculatorEnv
from posttrain.envs.python import PythonEnv
from posttrain.envs.tools import FunctionToolsEnv

SHIPPED = {"calculator": CalculatorEnv, "python": PythonEnv, "tools": FunctionToolsEnv}


def build_environment(config: EnvConfig) -> Environment:
    """The environment ``config.name`` names, built with ``config.kwargs``."""
    if config.name in SHIPPED:
        return SHIPPED[config.name](config, **config.kwargs)
    from posttrain.rewards.base import load_reward_function  # module:Name or path/file.py:Name, as rewards

    try:
        cls = load_reward_function(config.name, kind="class", label="environment")
    except (ImportError, ValueError, FileNotFoundError) as error:
        raise ValueError(f"env.name={config.name!r}: {error}") from error
    try:
        env = cls(config, **config.kwargs)
    except TypeError as error:
        raise ValueError(
            f"env.name={config.name}: {cls.__name__}(config, **env.kwargs) failed ({error}); an environment's "
            "constructor takes the run's EnvConfig, then env.kwargs as keywords"
        ) from error
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing or not hasattr(env, "tools"):
        what = ", ".join([f"a {m} method" for m in missing] + ([] if hasattr(env, "tools") else ["a tools attribute"]))
        raise ValueError(f"env.name={config.name}: {cls.__name__} lacks {what} (docs/algorithms/multi_turn.md)")
    return env


def environment_for(config: EnvConfig | None, tokenizer) -> Environment | None:
    """The environment ``config`` names, told the run's tokenizer (a tools environment checks whether the chat
    template renders ``tools=``); None for none."""
    if config is None or not config.enabled:
        return None
    env = build_environment(config)
    if hasattr(env, "use_tokenizer"):
        env.use_tokenizer(tokenizer)
    return env

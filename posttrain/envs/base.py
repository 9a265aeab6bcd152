"""The environment protocol of multi-turn episodes, the state of one episode, and the ``env`` config section.

An episode: ``reset(row)`` gives the first messages (the row's prompt, a system message naming the tools);
the policy writes a turn; ``step(state, turn)`` reads it and answers with new messages (a tool's result)
or ends the episode, with a reward or None. The episode runner (``posttrain.envs.episodes``) keeps the
token ids the policy sampled as they were sampled and renders only the environment's messages through
the chat template (docs/algorithms/multi_turn.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

ENVIRONMENTS = ("none", "calculator", "python", "tools")
ON_TOOL_ERROR = ("observe", "stop")
TURN_REWARDS = ("sum", "discount")
MAX_OUTPUT = 2000
"""Characters of a tool's answer given back to the model (``env.kwargs.max_output``); the rest is cut, saying so."""
UNSCORED = ("calculator", "python", "tools")
"""The shipped environments: they give no reward of their own, the run's reward functions score the answer."""
ENDS = ("model", "max_turns", "max_tokens", "tool_error")
"""How an episode ends: the model answered without a tool call; it was still calling tools after
``max_turns`` turns; a turn was cut without an end of turn (at ``sampling.max_new_tokens``, one turn's
limit, or at ``env.max_episode_tokens``, the episode's) or no room was left for another; a tool failed with
``on_tool_error=stop``."""


@dataclass
class EnvConfig:
    """The environment GRPO and PPO episodes run in (``env.name=none``: one prompt, one completion)."""

    name: str = "none"
    """none, calculator (``<calc>expression</calc>`` → its value), python (a fenced python block runs in the
    code sandbox, its output comes back), tools (the Python functions of ``env.tools``, offered through the
    chat template's ``tools=`` and called in its ``<tool_call>`` format), or ``module:Class`` of your own."""
    max_turns: int = 4
    """Most model turns per episode; an episode still calling tools after them ends (end = max_turns)."""
    max_episode_tokens: int = 512
    """Most tokens after the prompt per episode, the model's and the environment's together; a turn that
    reaches the budget is cut and ends the episode (end = max_tokens, truncated)."""
    tools: list[str] = field(default_factory=list)
    """env.name=tools: the functions, ``module:function`` or ``path/file.py:function``, with type hints and a
    docstring (transformers' get_json_schema turns them into the template's tool descriptions)."""
    tool_timeout: float = 10.0
    """Seconds one environment step may take: a turn's tool calls together (calls left when it is up are
    answered as errors), its python program, or its calculations."""
    tool_isolation: str = "process"
    """env.name=tools: process (each call in a forked worker, killed on timeout) or inline (a thread of this
    process: a hung call is abandoned, not killed)."""
    on_tool_error: str = "observe"
    """A tool that raises, times out or is called wrongly: observe (the error text is the tool's answer and
    the episode goes on) or stop (the episode ends there, end = tool_error, and trains as it stands)."""
    turn_rewards: str = "sum"
    """How the environment's per-turn rewards make the episode's: sum, or discount (Σ_k γ^k r_k over model
    turns k = 0, 1, ...). The episode reward joins the reward functions' as ``environment_reward``."""
    gamma: float = 1.0
    """γ of turn_rewards=discount."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments for the environment's constructor (e.g. a system prompt)."""

    def validate(self, name: str = "env") -> None:
        if self.name not in ENVIRONMENTS and ":" not in self.name:
            raise ValueError(f"{name}.name must be one of {ENVIRONMENTS} or module:Class, got {self.name!r}")
        for key in ("max_turns", "max_episode_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"{name}.{key} must be >= 1, got {getattr(self, key)}")
        for key, allowed in (
            ("on_tool_error", ON_TOOL_ERROR),
            ("turn_rewards", TURN_REWARDS),
            ("tool_isolation", ("process", "inline")),
        ):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{name}.{key} must be one of {allowed}, got {getattr(self, key)!r}")
        if not 0 < self.tool_timeout < float("inf"):
            raise ValueError(f"{name}.tool_timeout must be finite and > 0 (seconds), got {self.tool_timeout}")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"{name}.gamma must be in [0, 1], got {self.gamma}")
        if self.name == "tools" and not self.tools:
            raise ValueError(f"{name}.name=tools needs {name}.tools: [module:function, ...]")
        if self.tools and self.name != "tools":
            raise ValueError(f"{name}.tools applies to {name}.name=tools only, got name={self.name}")

    @property
    def enabled(self) -> bool:
        return self.name != "none"


@dataclass
class StepResult:
    """What the environment answers to one model turn."""

    messages: list[dict] = field(default_factory=list)
    """Chat messages ({"role": "tool", "content": ...}) the model reads before its next turn."""
    done: bool = False
    """The episode ends here (the model gave its answer)."""
    reward: float | None = None
    """This turn's reward; None = the environment does not score it (the reward functions may)."""
    tool_calls: int = 0
    """Tool calls the turn made."""
    tool_errors: int = 0
    """Of those, calls that raised, timed out or could not be parsed."""


@dataclass
class EpisodeState:
    """One episode as it runs: its row, the messages so far (the model's turns as the text it wrote), what
    the environment keeps between turns (``data``) and the counts its metrics come from."""

    row: dict
    messages: list[dict]
    data: dict = field(default_factory=dict)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    rewards: list[float | None] = field(default_factory=list)
    end: str = ""
    env_seconds: float = 0.0


class Environment(Protocol):
    """What an episode needs of an environment. ``tools``: JSON schemas for the chat template's ``tools=``
    (None: the template is rendered without). Optional: ``concurrent_steps`` (how many episodes' ``step``
    may run at once in threads; 1 when absent), ``use_tokenizer(tokenizer)`` (told the run's tokenizer)."""

    tools: list[dict] | None

    def reset(self, row: dict) -> list[dict]:
        """The first messages of an episode for the data row ``row`` (its "prompt" and other columns)."""
        ...

    def step(self, state: EpisodeState, turn: str) -> StepResult:
        """The answer to the model's turn ``turn`` (its text, special tokens removed)."""
        ...


def prompt_messages(row: dict, system: str | None = None) -> list[dict]:
    """The row's prompt as chat messages (a string becomes one user message), after an optional system one."""
    prompt = row["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def episode_reward(rewards: list[float | None], how: str, gamma: float) -> float | None:
    """R = Σ_k r_k (sum) or Σ_k γ^k r_k (discount) over the turns k whose reward is not None; None when none is."""
    scored = [(k, r) for k, r in enumerate(rewards) if r is not None]
    if not scored:
        return None
    return float(sum(r * (gamma**k if how == "discount" else 1.0) for k, r in scored))


def tagged(text: str, opening: str, closing: str) -> list[str]:
    """The texts between each ``opening`` and the first ``closing`` after it, in order, as a non-greedy regular
    expression finds them, in linear time: a lazy pattern rescans the rest of the turn from every unclosed
    opening (2,000 ``<tool_call>`` without a close took seconds, holding the interpreter's lock)."""
    found, at = [], 0
    while (start := text.find(opening, at)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            break
        found.append(text[start + len(opening) : end])
        at = end + len(closing)
    return found


def cut(text: str, limit: int) -> str:
    """``text`` whole when it has at most ``limit`` characters, else its first ``limit`` and a line saying how many
    were cut: what a tool answers goes into the model's context and the run's samples."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[... {len(text) - limit} characters cut]"


ENVIRONMENT_REWARD = "posttrain.rewards.builtin:environment_reward"
"""The reward function every run with an environment adds to its own: the episode's reward."""


def with_environment_reward(specs: list, config: EnvConfig | None) -> list:
    """``specs`` (``RewardSpec``s) and, with an environment, the environment's reward (``ENVIRONMENT_REWARD``),
    once: listed by the user too, it is not added again."""
    from posttrain.rewards import RewardSpec

    if config is None or not config.enabled or any(s.function == ENVIRONMENT_REWARD for s in specs):
        return list(specs)
    return [*specs, RewardSpec(function=ENVIRONMENT_REWARD, isolation="inline")]


def data_specs(specs: list) -> list:
    """The reward specs whose columns the data rows must hold: all but the environment's reward (its column is
    written by the episodes)."""
    return [s for s in specs if s.function != ENVIRONMENT_REWARD]


def env_columns(states: list[EpisodeState], config: EnvConfig) -> dict[str, list[Any]]:
    """The per-episode columns a rollout carries: the reward functions read ``environment_reward``; the
    metrics and samples.jsonl the rest."""
    return {
        "environment_reward": [episode_reward(s.rewards, config.turn_rewards, config.gamma) for s in states],
        "turns": [s.turns for s in states],
        "tool_calls": [s.tool_calls for s in states],
        "tool_errors": [s.tool_errors for s in states],
        "end": [s.end for s in states],
        "env_seconds": [s.env_seconds for s in states],
        "episode": [s.messages for s in states],
    }

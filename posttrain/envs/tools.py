"""Function tools: plain Python functions with type hints and a docstring, offered to the model through the
chat template's ``tools=`` (transformers' ``get_json_schema``), called in the template's format
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes; Qwen2.5/3, SmolLM3 and others use
it). A turn's calls run one after another under one deadline, ``env.tool_timeout`` from the turn's first call
(calls left when it is up are answered as errors without running); the episodes of a turn run their steps
side by side (``concurrent_steps``, process isolation), so a turn of hanging calls costs about one timeout.
A result is turned into text in the worker and cut to ``max_output`` characters there, saying so.

A template that ignores ``tools=`` (it renders the same with and without) gets the descriptions in a
system message instead, in the same format, so any chat model can be offered the tools.
"""

from __future__ import annotations

import json
import time
from functools import partial

from posttrain.envs.base import MAX_OUTPUT, EnvConfig, EpisodeState, StepResult, cut, prompt_messages, tagged

SYSTEM = (
    "You may call functions to help with the question. The functions, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    'To call one, write <tool_call>{{"name": <function name>, "arguments": <arguments as JSON>}}</tool_call>; '
    "its result comes back before you continue."
)


def tool_schema(fn) -> dict:
    """The JSON schema of ``fn`` the chat template reads (its name, docstring, typed arguments)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as error:  # transformers' own parse errors: a missing hint or argument description
        raise ValueError(
            f"env.tools: {getattr(fn, '__name__', fn)} cannot be offered as a tool ({error}); a tool needs a type "
            "hint on every argument and a docstring with an Args: line for each"
        ) from error


def parse_tool_calls(turn: str) -> list[tuple[str | None, dict | None, str]]:
    """[(name, arguments, error)] of every ``<tool_call>`` in ``turn``; error is "" for a well-formed call."""
    calls = []
    for body in tagged(turn, "<tool_call>", "</tool_call>"):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append((None, None, f"the tool call is not JSON ({error.msg})"))
            continue
        except (RecursionError, MemoryError):  # JSON nested deeper than Python's stack
            calls.append((None, None, "the tool call is nested too deeply to read"))
            continue
        name, arguments = (call.get("name"), call.get("arguments", {})) if isinstance(call, dict) else (None, None)
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError, MemoryError):
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            calls.append((None, None, 'a tool call is {"name": string, "arguments": object}'))
            continue
        calls.append((name, arguments, ""))
    return calls


def _invoke(tool, arguments: dict, max_output: int, prompts, completions) -> list[str]:
    """``tool(**arguments)`` as text, cut to ``max_output`` characters, in the worker (a result of megabytes
    or one nested too deeply to print stays there). The arguments come as one dict, never as keywords of
    this wrapper: a tool's parameters may have any name (``c``, ``prompts``, ``self``, ``tool``)."""
    return [cut(str(tool(**arguments)), max_output)]


class FunctionToolsEnv:
    """``env.name=tools`` with ``env.tools``. kwargs: ``system`` (a system message of your own for the first
    turn), ``max_output`` (characters of a result given back, ``MAX_OUTPUT``), ``concurrent_steps`` (how many
    episodes' calls run at once, each call in its own worker, with ``tool_isolation=process``; inline calls
    share one thread and run one at a time)."""

    def __init__(
        self, config: EnvConfig, system: str | None = None, max_output: int = MAX_OUTPUT, concurrent_steps: int = 32
    ):
        from posttrain.rewards.base import load_reward_function

        self.config = config
        self.max_output = max_output
        self.concurrent_steps = concurrent_steps if config.tool_isolation == "process" else 1
        self.functions = {}
        for spec in config.tools:
            fn = load_reward_function(spec, label="tool")
            self.functions[fn.__name__] = fn
        self.tools = [tool_schema(fn) for fn in self.functions.values()]
        self.system = system
        self.in_template = True  # set by ``use_tokenizer``

    def use_tokenizer(self, tokenizer) -> None:
        """Whether ``tokenizer``'s template renders ``tools=``; if not, the descriptions go in a system message."""
        probe = [{"role": "user", "content": "x"}]
        plain = tokenizer.apply_chat_template(probe, tokenize=False)
        self.in_template = tokenizer.apply_chat_template(probe, tools=self.tools, tokenize=False) != plain

    def reset(self, row: dict) -> list[dict]:
        system = self.system
        if system is None and not self.in_template:
            system = SYSTEM.format(tools="\n".join(json.dumps(t) for t in self.tools))
        return prompt_messages(row, system)

    def step(self, state: EpisodeState, turn: str) -> StepResult:
        calls = parse_tool_calls(turn)
        if not calls:
            return StepResult(done=True)
        messages, errors = [], 0
        deadline = time.monotonic() + self.config.tool_timeout
        for name, arguments, error in calls:
            if not error and name not in self.functions:
                error = f"no tool named {name!r:.100} (the tools: {', '.join(self.functions)})"
            left = deadline - time.monotonic()
            if not error and left <= 0:
                error = f"not run: this turn's tool calls used up env.tool_timeout={self.config.tool_timeout:g} s"
            result = self._call(name, arguments, left) if not error else ("error", error)
            if result[0] != "ok":
                errors += 1
            content = result[1] if result[0] == "ok" else f"error: {result[1]}"
            messages.append({"role": "tool", "name": name if name in self.functions else "", "content": content})
        if errors and self.config.on_tool_error == "stop":
            return StepResult(done=True, tool_calls=len(calls), tool_errors=errors)
        return StepResult(messages=messages, tool_calls=len(calls), tool_errors=errors)

    def _call(self, name: str, arguments: dict, timeout: float) -> tuple[str, str]:
        """("ok", the result as text) or ("error", why): a raise (its last line), a timeout, wrong arguments,
        a worker that could not start."""
        from posttrain.rewards.base import call_with_timeout

        call = partial(_invoke, self.functions[name], arguments, self.max_output)
        try:
            status, value = call_with_timeout(call, [], [], {}, timeout, self.config.tool_isolation)
        except OSError as error:  # fork refused (no memory, too many processes): this call fails, not the run
            return "error", f"{name} could not start ({error})"
        if status == "ok":
            return "ok", value[0]
        if status == "timeout":
            limit = self.config.tool_timeout
            if timeout >= limit - 0.05:  # the call had the turn's whole budget (less the moments before it)
                return "error", f"{name} did not return within {limit:g} s"
            return (
                "error",
                f"{name} did not return within the {round(timeout, 2):g} s left of env.tool_timeout={limit:g} s",
            )
        lines = str(value).strip().splitlines()
        return "error", cut(lines[-1], self.max_output) if lines else status

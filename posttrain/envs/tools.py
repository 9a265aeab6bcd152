"""Function tools: plain Python functions with type hints and a docstring, offered to the model through the
chat template's ``tools=`` (transformers' ``get_json_schema``), called in the template's format
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes; Qwen2.5/3, SmolLM3 and others use
it), each call run under ``env.tool_timeout``.

A template that ignores ``tools=`` (it renders the same with and without) gets the descriptions in a
system message instead, in the same format, so any chat model can be offered the tools.
"""

from __future__ import annotations

import json
import re

from posttrain.envs.base import EnvConfig, EpisodeState, StepResult, prompt_messages

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
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
    for body in CALL.findall(turn):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append((None, None, f"the tool call is not JSON ({error.msg})"))
            continue
        name, arguments = (call.get("name"), call.get("arguments", {})) if isinstance(call, dict) else (None, None)
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            calls.append((None, None, 'a tool call is {"name": string, "arguments": object}'))
            continue
        calls.append((name, arguments, ""))
    return calls


def _invoke(tool, prompts, completions, **arguments):
    return [tool(**arguments)]


class FunctionToolsEnv:
    """``env.name=tools`` with ``env.tools``. kwargs: ``system`` (a system message of your own for the first
    turn), ``tokenizer`` (set by the runner: decides whether the template renders ``tools=``)."""

    def __init__(self, config: EnvConfig, system: str | None = None):
        from posttrain.rewards.base import load_reward_function

        self.config = config
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
        for name, arguments, error in calls:
            if not error and name not in self.functions:
                error = f"no tool named {name!r} (the tools: {', '.join(self.functions)})"
            result = self._call(name, arguments) if not error else ("error", error)
            if result[0] != "ok":
                errors += 1
            content = str(result[1]) if result[0] == "ok" else f"error: {result[1]}"
            messages.append({"role": "tool", "name": name or "", "content": content})
        if errors and self.config.on_tool_error == "stop":
            return StepResult(done=True, tool_calls=len(calls), tool_errors=errors)
        return StepResult(messages=messages, tool_calls=len(calls), tool_errors=errors)

    def _call(self, name: str, arguments: dict) -> tuple[str, object]:
        """("ok", the result) or ("error", why): a raise (its last line), a timeout, wrong arguments."""
        from posttrain.rewards.base import call_with_timeout

        status, value = call_with_timeout(
            lambda p, c, **a: _invoke(self.functions[name], p, c, **a),
            [],
            [],
            arguments,
            self.config.tool_timeout,
            self.config.tool_isolation,
        )
        if status == "ok":
            return "ok", value[0]
        if status == "timeout":
            return "error", f"{name} did not return within {self.config.tool_timeout:g} s"
        lines = str(value).strip().splitlines()
        return "error", lines[-1] if lines else status

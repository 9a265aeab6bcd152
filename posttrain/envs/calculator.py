"""A calculator tool: the model writes ``<calc>1234*56</calc>``, the environment answers ``69104``.

The expression is evaluated by walking its syntax tree (numbers, + − × ÷ // % **, parentheses), never
by ``eval``: a model's text cannot run code here. A turn without a ``<calc>`` call is the answer and
ends the episode; the reward functions score it (e.g. ``posttrain.rewards.builtin:exact_answer``).

Whatever the model writes, a step ends soon: an expression has at most ``MAX_LENGTH`` characters and
``MAX_DEPTH`` nested operations, and every value, before a power is computed and after each operation, is
a finite float or an integer of at most ``MAX_BITS`` bits, so one calculation takes well under a
millisecond; the calculations of one turn stop at ``env.tool_timeout``. Anything else is the tool's error.
"""

from __future__ import annotations

import ast
import math
import operator
import time

from posttrain.envs.base import MAX_OUTPUT, EnvConfig, EpisodeState, StepResult, cut, prompt_messages, tagged

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_EXPONENT = 64  # 10**64 is fine; 9**9**9 would take the trainer's memory and minutes
MAX_BITS = 1024  # an integer value below 2**1024 (309 digits), the float range: ((9**64)**64)**64 is refused
MAX_LENGTH = 1000  # characters of one expression
MAX_DEPTH = 100  # operations nested in one another (2,000 unary minus signs would exhaust Python's stack)
SYSTEM = "To compute, write <calc>expression</calc> and read its value; then give the answer."
FAILURES = (ValueError, ArithmeticError, TypeError, RecursionError, MemoryError)
"""What a calculation may raise, each the tool's error: OverflowError and ZeroDivisionError are ArithmeticErrors."""


def calculate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``; ValueError for anything else (names, calls, values too large,
    expressions too long or nested too deeply)."""
    text = expression.strip()
    if len(text) > MAX_LENGTH:
        raise ValueError(f"the expression has {len(text)} characters, more than {MAX_LENGTH}")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as error:
        raise ValueError(f"not an arithmetic expression: {expression!r:.100}") from error
    except (RecursionError, MemoryError) as error:  # the parser's own stack
        raise ValueError(f"the expression is nested more than {MAX_DEPTH} deep") from error
    try:
        return _value(tree.body, 0, text)
    except ZeroDivisionError as error:
        raise ValueError("division by zero") from error


def _value(node: ast.AST, depth: int, text: str) -> int | float:
    """The value of one node of ``text``'s syntax tree, ``depth`` operations deep, checked (``_checked``)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"the expression is nested more than {MAX_DEPTH} deep")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _value(node.left, depth + 1, text), _value(node.right, depth + 1, text)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(OPERATORS[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return _checked(OPERATORS[type(node.op)](_value(node.operand, depth + 1, text)))
    raise ValueError(f"not an arithmetic expression: {text!r:.100}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse ``base ** exponent`` before computing it when the exponent or the value would be too large:
    |base| ≥ 2^(b−1) for an integer of b bits, so the value has more than e·(b−1) bits."""
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} is larger than {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and exponent * (base.bit_length() - 1) >= MAX_BITS:
        raise ValueError(f"the value has more than {MAX_BITS} bits")


def _checked(x):
    """``x`` when it is a finite float or an integer of at most ``MAX_BITS`` bits; ValueError otherwise."""
    if isinstance(x, int) and x.bit_length() > MAX_BITS:
        raise ValueError(f"the value has more than {MAX_BITS} bits")
    if isinstance(x, float) and not math.isfinite(x):
        raise ValueError("the value is not a finite number")
    if not isinstance(x, int | float):  # a negative number to a fractional power is complex
        raise ValueError(f"the value is not a real number: {x!r:.60}")
    return x


def format_value(x: int | float) -> str:
    """An integer-valued result without a trailing .0 (``6/3`` → ``2``)."""
    return str(int(x)) if isinstance(x, float) and x.is_integer() and abs(x) < 2**53 else str(x)


class CalculatorEnv:
    """``env.name=calculator``. kwargs: ``system`` (a system message for the first turn; none by default,
    for templates such as the tiny models' that render a system message as plain text)."""

    tools = None

    def __init__(self, config: EnvConfig, system: str | None = None, max_output: int = MAX_OUTPUT):
        self.config = config
        self.system = system
        self.max_output = max_output

    def reset(self, row: dict) -> list[dict]:
        return prompt_messages(row, self.system)

    def step(self, state: EpisodeState, turn: str) -> StepResult:
        calls = tagged(turn, "<calc>", "</calc>")
        if not calls:
            return StepResult(done=True)
        answers, errors, late = [], 0, ""
        deadline = time.monotonic() + self.config.tool_timeout
        for i, expression in enumerate(calls):
            if time.monotonic() > deadline:
                errors += len(calls) - i
                late = (
                    f"\nerror: {len(calls) - i} calculations not done: this turn's calculations used up "
                    f"env.tool_timeout={self.config.tool_timeout:g} s"
                )
                break
            try:
                answers.append(format_value(calculate(expression)))
            except FAILURES as error:
                answers.append(f"error: {error}")
                errors += 1
        if errors and self.config.on_tool_error == "stop":
            return StepResult(done=True, tool_calls=len(calls), tool_errors=errors)
        content = (cut("\n".join(answers), self.max_output) + late).strip()
        return StepResult(messages=[{"role": "tool", "content": content}], tool_calls=len(calls), tool_errors=errors)

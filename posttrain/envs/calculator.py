"""A calculator tool: the model writes ``<calc>1234*56</calc>``, the environment answers ``69104``.

The expression is evaluated by walking its syntax tree (numbers, + − × ÷ // % **, parentheses), never
by ``eval``: a model's text cannot run code here. A turn without a ``<calc>`` call is the answer and
ends the episode; the reward functions score it (e.g. ``posttrain.rewards.builtin:exact_answer``).
"""

from __future__ import annotations

import ast
import operator
import re

from posttrain.envs.base import EnvConfig, EpisodeState, StepResult, prompt_messages

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
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
SYSTEM = "To compute, write <calc>expression</calc> and read its value; then give the answer."


def calculate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``; ValueError for anything else (names, calls, huge powers)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from error

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
            return OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    try:
        return value(tree.body)
    except ZeroDivisionError as error:
        raise ValueError("division by zero") from error


def format_value(x: int | float) -> str:
    """An integer-valued result without a trailing .0 (``6/3`` → ``2``)."""
    return str(int(x)) if isinstance(x, float) and x.is_integer() and abs(x) < 2**53 else str(x)


class CalculatorEnv:
    """``env.name=calculator``. kwargs: ``system`` (a system message for the first turn; none by default,
    for templates such as the tiny models' that render a system message as plain text)."""

    tools = None

    def __init__(self, config: EnvConfig, system: str | None = None):
        self.config = config
        self.system = system

    def reset(self, row: dict) -> list[dict]:
        return prompt_messages(row, self.system)

    def step(self, state: EpisodeState, turn: str) -> StepResult:
        calls = CALL.findall(turn)
        if not calls:
            return StepResult(done=True)
        answers, errors = [], 0
        for expression in calls:
            try:
                answers.append(format_value(calculate(expression)))
            except (ValueError, OverflowError, TypeError) as error:
                answers.append(f"error: {error}")
                errors += 1
        if errors and self.config.on_tool_error == "stop":
            return StepResult(done=True, tool_calls=len(calls), tool_errors=errors)
        return StepResult(
            messages=[{"role": "tool", "content": "\n".join(answers)}], tool_calls=len(calls), tool_errors=errors
        )

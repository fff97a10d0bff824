"""``calculator``: the student may call a calculator before it answers.

A turn holding ``<calc>EXPRESSION</calc>`` is a tool call: the environment answers with the
exact value (integers and fractions; ``+ - * /`` and parentheses), in a message of role
``result_role``. A turn without one is the final answer, graded by the dataset's grader
(reward 1.0 for a right one), which ends the episode. A student that never calls the tool
answers in one turn, as it would without the environment.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from opd.data.graders import Grader
from opd.data.prompts import Prompt
from opd.envs.base import Environment, Episode, Step

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
"""The tool-call tag a student writes: ``<calc>4821+9377</calc>``."""
MAX_DIGITS = 200
"""Results longer than this are refused: a student's expression should not cost the trainer."""

_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def _value(node: ast.AST) -> Fraction:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _value(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        result = _OPERATORS[type(node.op)](left, right)
        if len(str(result.numerator)) + len(str(result.denominator)) > MAX_DIGITS:
            raise ValueError("result too large")
        return result
    raise ValueError("only numbers, + - * / and parentheses")


def calculate(expression: str) -> str:
    """The exact value of an arithmetic expression as text (``7``, ``-3/4``), or ``error: why``."""
    text = expression.strip().replace(",", "")
    if not text or len(text) > MAX_DIGITS:
        return "error: empty or too long"
    try:
        value = _value(ast.parse(text, mode="eval").body)
    except SyntaxError:
        return "error: not an arithmetic expression"
    except (ValueError, RecursionError) as error:
        return f"error: {error}"
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )


@dataclass
class CalculatorEpisode(Episode):
    """One question: tool calls answered until a turn without one, which is graded."""

    prompt: Prompt
    grader: Grader | None
    result_role: str
    calls: int = 0

    def step(self, reply: str) -> Step:
        found = CALL.search(reply)
        if found:
            self.calls += 1
            return Step(
                messages=({"role": self.result_role, "content": calculate(found.group(1))},)
            )
        reward = None if self.grader is None else float(self.grader(reply, self.prompt))
        return Step(done=True, reward=reward, metrics={"tool_calls": float(self.calls)})


@dataclass(frozen=True)
class Calculator(Environment):
    """A calculator the student may call (``<calc>...</calc>``) before its final answer."""

    name = "calculator"
    result_role: Literal["tool", "user"] = "tool"
    """The role of the calculator's answer: ``tool``, or ``user`` for chat templates without a tool
    role."""

    def start(self, prompt: Prompt, grader: Grader | None) -> CalculatorEpisode:
        return CalculatorEpisode(prompt, grader, self.result_role)

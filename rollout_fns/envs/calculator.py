"""An example environment for `rollout_fns.multi_turn`: arithmetic questions with a calculator tool that answers
after a random latency. The model calls the tool by writing `<calc>EXPR</calc>` and ends with `\\boxed{ANSWER}`,
which is scored against the prompt's label."""
from __future__ import annotations

import ast
import asyncio
import operator
import random
import re
from dataclasses import dataclass

from rollout_fns.envs import Action, StepResult

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
ANSWER = re.compile(r"\\boxed\{([^{}]*)\}")
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64  # keeps `9**9**9` from tying up the event loop


@dataclass(frozen=True)
class CalcCall:
    """A parsed turn: a tool call (`kind="calc"`, `arg` the expression) or the final answer (`kind="answer"`)."""

    kind: str
    arg: str


def parse_call(text: str) -> CalcCall:
    """The turn's final answer if it has `\\boxed{...}`, else its first `<calc>...</calc>` call; ValueError (a
    malformed turn) when it has neither. Usable as the task's `parse_action` hook."""
    answer = ANSWER.search(text)
    if answer:
        return CalcCall("answer", answer.group(1).strip())
    call = CALL.search(text)
    if call:
        return CalcCall("calc", call.group(1).strip())
    raise ValueError("no <calc>EXPR</calc> tool call and no \\boxed{} answer in the turn")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); ValueError for anything else."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    raise ValueError(f"unsupported expression {ast.unparse(node)!r}")


def same_number(answer: str, label: object) -> bool:
    try:
        return abs(float(answer) - float(label)) < 1e-9
    except (TypeError, ValueError):
        return False


class CalculatorEnv:
    """One episode of a calculator-assisted arithmetic question (the prompt dict's "label" is the answer).

    latency_s: each tool call sleeps a uniform random time in [low, high] seconds, like a real tool would take.
    A tool call returns the value as the observation (reward 0); a bad expression is a tool error (the step's
    `error`, the observation "error: ..."); a `\\boxed{}` answer ends the episode with reward 1 if it equals the
    label, else 0.
    """

    def __init__(self, *, latency_s: tuple[float, float] | list[float] = (0.0, 0.0), seed: int | None = None):
        low, high = latency_s
        if not 0 <= low <= high:
            raise ValueError(f"CalculatorEnv: latency_s must be [low, high] with 0 <= low <= high, got {latency_s}")
        self.latency_s, self.rng = (float(low), float(high)), random.Random(seed)
        self.label: object = None
        self.calls = 0  # tool calls made in this episode

    async def reset(self, prompt: dict) -> None:
        self.label, self.calls = prompt.get("label"), 0
        return None

    async def step(self, action: Action) -> StepResult:
        call = action.parsed if isinstance(action.parsed, CalcCall) else parse_call(action.text)
        if call.kind == "answer":
            return StepResult(reward=1.0 if same_number(call.arg, self.label) else 0.0, done=True)
        self.calls += 1
        await asyncio.sleep(self.rng.uniform(*self.latency_s))
        try:
            value = evaluate(call.arg)
        except ValueError as err:
            return StepResult(observation=f"error: {err}", error=str(err))
        return StepResult(observation=str(value))

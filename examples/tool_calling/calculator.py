"""A calculator tool for verl's ToolAgentLoop: evaluates one arithmetic expression safely.

It is a `verl.tools.base_tool.BaseTool`, declared in `tools.yaml` beside this file, so it is
loaded the way verl loads any native tool (`actor_rollout_ref.rollout.multi_turn.tool_config_path`).
Expressions are parsed with `ast` and only numbers and + - * / // % ** and unary minus are
evaluated: a model can write anything, and `eval` on model output would run it.

The tool reward (the second value `execute` returns, collected by verl into `tool_rewards`) is
1.0 for an expression that evaluated and 0.0 for one that did not, a simple signal that the
model called the tool well.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
# A model asking for 9**9**9 must not hang a rollout worker.
_MAX_EXPONENT = 64
_MAX_EXPRESSION_CHARS = 200

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The expression, e.g. (12 + 7) * 3"}},
            "required": ["expression"],
        },
    },
}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or cannot be evaluated."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; raises CalculatorError for anything else."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
    return _evaluate_node(tree.body)


def _evaluate_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate_node(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate_node(node.left), _evaluate_node(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
        try:
            return _BINARY[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError) as exc:
            raise CalculatorError(str(exc)) from None
    raise CalculatorError(f"unsupported element {type(node).__name__} (only numbers and + - * / // % **)")


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class CalculatorTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema or OpenAIFunctionToolSchema.model_validate(SCHEMA))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        expression = parameters.get("expression")
        if not isinstance(expression, str):
            return ToolResponse(text="error: give the expression as a string argument 'expression'"), 0.0, {}
        try:
            value = evaluate(expression)
        except CalculatorError as exc:
            return ToolResponse(text=f"error: {exc}"), 0.0, {}
        return ToolResponse(text=format_number(value)), 1.0, {}

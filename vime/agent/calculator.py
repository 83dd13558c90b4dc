"""The built-in `calculator` tool: evaluates an arithmetic expression, safely.

Only numbers, + - * / // % ** and parentheses are accepted (the expression is parsed with `ast`, never
`eval`'d); exponents are bounded so a call cannot hang the server. Anything else raises ValueError,
which a tool server reports to the model as the call's error.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}  # fmt: skip
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 100
MAX_LENGTH = 200


def calculator(expression: str) -> str:
    """The value of `expression`, as text (integers without a decimal point)."""
    if not isinstance(expression, str) or len(expression) > MAX_LENGTH:
        raise ValueError(f"expression must be a string of at most {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        try:
            return _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported element in expression: {ast.dump(node)[:80]}")

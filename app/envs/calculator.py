"""The calculator tool of the ``calculator`` environment: arithmetic on integers, nothing else.

No code is executed: the expression is parsed with Python's ``ast`` module in ``eval`` mode and
walked by `evaluate`, which accepts only integer literals, parentheses, unary ``+``/``-`` and the
binary operators ``+ - * // %`` and ``**``. Names, attributes, calls, subscripts, strings, floats,
comparisons, lambdas and everything else are refused before anything is computed. Resources are
bounded by construction, so no call can run long or grow large:

* input: at most `MAX_CHARS` characters and `MAX_NODES` syntax nodes (``ast.parse`` itself is
  linear in the input);
* CPU and memory: every intermediate value must stay within ``|x| <= MAX_ABS`` (10**18), and a
  power is computed only when its result provably fits (exponent 0..`MAX_EXPONENT`, checked
  from the operands' sizes before ``**`` runs), so each operation is a machine-word-sized
  integer operation;
* output: the result as decimal text, at most 20 characters; errors are one short line;
* no I/O: the evaluator touches no file, socket or process and imports nothing at run time.

Division is integer floor division (``//``), as Python defines it; ``/`` is refused, so every
result is an exact integer.
"""

from __future__ import annotations

import ast
import operator

MAX_CHARS = 128
MAX_NODES = 64
MAX_ABS = 10**18
MAX_EXPONENT = 64

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """The expression is not one the calculator takes, or its value is out of range; the
    message is one short line that the environment shows the policy."""


def _bounded(x: int) -> int:
    if abs(x) > MAX_ABS:
        raise CalcError("result too large")
    return x


def _power(base: int, exp: int) -> int:
    if exp < 0 or exp > MAX_EXPONENT:
        raise CalcError(f"exponent must be 0..{MAX_EXPONENT}")
    # |base| ** exp <= MAX_ABS is decided from bit lengths before anything is computed.
    if abs(base) > 1 and (abs(base).bit_length() - 1) * exp > MAX_ABS.bit_length():
        raise CalcError("result too large")
    return _bounded(base**exp)


def _walk(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _walk(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_walk(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalcError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        raise CalcError("use // for division")
    raise CalcError(f"not allowed: {type(node).__name__}")


def evaluate(expression: str) -> int:
    """The integer value of an arithmetic ``expression`` (see the module docstring).

    Args:
        expression: e.g. ``"95*21"``, ``"(3+4)**2 // 5"``; spaces are ignored.

    Returns:
        The exact integer value, ``|value| <= MAX_ABS``.

    Raises:
        CalcError: empty, longer than `MAX_CHARS`, not valid syntax, more than `MAX_NODES`
            nodes, anything but integers and the allowed operators, division by zero, an
            exponent outside 0..`MAX_EXPONENT`, or a value beyond `MAX_ABS`.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise CalcError("empty expression")
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        raise CalcError("not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"more than {MAX_NODES} terms and operators")
    return _walk(tree)

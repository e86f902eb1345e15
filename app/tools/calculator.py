"""A safe arithmetic evaluator for the ``calculator`` tool, walking Python's ``ast`` (never eval/exec).

Accepted: int and float literals, ``+ - * / // % **`` (``^`` also means power, as people write it),
unary ``+``/``-``, parentheses, and a whitelist of math names: ``sqrt sin cos tan log log10 exp abs
round min max`` and ``pi e tau``. Everything else (names, attributes, calls of other things,
subscripts, lambdas, comprehensions, strings) is refused with a ``CalculatorError`` saying why.

Work is bounded before it is done: the expression length, the node count, and the size of every
intermediate result (a power is refused by estimating its digits first, so ``9**9**9`` fails at once).
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from typing import Any

Number = int | float

MAX_EXPRESSION_CHARS = 500
MAX_NODES = 400
MAX_INT_DIGITS = 300
MAX_CALL_ARGS = 50
MAX_FLOAT = 1e300

_TRANSLATE = str.maketrans({"×": "*", "÷": "/", "−": "-"})


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated; the message says why."""


def _log(x: Number, base: Number | None = None) -> float:
    return math.log(x) if base is None else math.log(x, base)


def _round(x: Number, ndigits: int | None = None) -> Number:
    if ndigits is None:
        return round(x)
    if not isinstance(ndigits, int):
        raise CalculatorError("round() takes a whole number of digits")
    return round(x, max(-MAX_INT_DIGITS, min(ndigits, MAX_INT_DIGITS)))


def _min(*args: Number) -> Number:
    if not args:
        raise CalculatorError("min() needs at least one argument")
    return min(args)


def _max(*args: Number) -> Number:
    if not args:
        raise CalculatorError("max() needs at least one argument")
    return max(args)


FUNCTIONS: dict[str, tuple[Callable[..., Number], int, int]] = {
    # name: (function, min args, max args)
    "sqrt": (math.sqrt, 1, 1),
    "sin": (math.sin, 1, 1),
    "cos": (math.cos, 1, 1),
    "tan": (math.tan, 1, 1),
    "log": (_log, 1, 2),
    "log10": (math.log10, 1, 1),
    "exp": (math.exp, 1, 1),
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "min": (_min, 1, MAX_CALL_ARGS),
    "max": (_max, 1, MAX_CALL_ARGS),
}
CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau}


def evaluate(expression: str) -> Number:
    """The value of ``expression``; raises ``CalculatorError`` for anything not allowed."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    text = expression.translate(_TRANSLATE).strip()
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not a valid arithmetic expression ({exc.msg})") from None
    except ValueError as exc:
        raise CalculatorError(f"not a valid arithmetic expression ({exc})") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("the expression is nested too deeply") from None
    nodes = sum(1 for node in ast.walk(tree) if isinstance(node, ast.expr))
    if nodes > MAX_NODES:
        raise CalculatorError(f"the expression is too complex (more than {MAX_NODES} parts)")
    try:
        return _Evaluator().visit(tree.body)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("the result is too large") from None


def format_number(value: Number) -> str:
    """``391``, ``0.333333333333``, ``1.5e+20``: integers stay exact, floats get 12 significant digits."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


class _Evaluator:
    def visit(self, node: ast.AST) -> Number:
        if isinstance(node, ast.Constant):
            return self._constant(node.value)
        if isinstance(node, ast.BinOp):
            return self._binop(node)
        if isinstance(node, ast.UnaryOp):
            operand = self.visit(node.operand)
            if isinstance(node.op, ast.USub):
                return -operand
            if isinstance(node.op, ast.UAdd):
                return +operand
            raise CalculatorError(f"the operator {type(node.op).__name__} is not allowed")
        if isinstance(node, ast.Name):
            if node.id in CONSTANTS:
                return CONSTANTS[node.id]
            if node.id in FUNCTIONS:
                raise CalculatorError(f"{node.id} is a function: call it like {node.id}(x)")
            raise CalculatorError(f"unknown name {node.id!r}; allowed: {', '.join(sorted(CONSTANTS))}")
        if isinstance(node, ast.Call):
            return self._call(node)
        raise CalculatorError(f"{_describe(node)} is not allowed in a calculation")

    @staticmethod
    def _constant(value: Any) -> Number:
        # bool is an int subclass; True + True is not arithmetic anyone means.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {type(value).__name__}")
        return _checked(value)

    def _binop(self, node: ast.BinOp) -> Number:
        left = self.visit(node.left)
        right = self.visit(node.right)
        op = node.op
        if isinstance(op, ast.Add):
            return _checked(left + right)
        if isinstance(op, ast.Sub):
            return _checked(left - right)
        if isinstance(op, ast.Mult):
            if isinstance(left, int) and isinstance(right, int) and left and right:
                if _digits(left) + _digits(right) > MAX_INT_DIGITS + 1:
                    raise CalculatorError("the result is too large")
            return _checked(left * right)
        if isinstance(op, ast.Div):
            return _checked(left / right)
        if isinstance(op, ast.FloorDiv):
            return _checked(left // right)
        if isinstance(op, ast.Mod):
            return _checked(left % right)
        if isinstance(op, (ast.Pow, ast.BitXor)):
            return _power(left, right)
        raise CalculatorError(f"the operator {type(op).__name__} is not allowed")

    def _call(self, node: ast.Call) -> Number:
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            allowed = ", ".join(sorted(FUNCTIONS))
            name = node.func.id if isinstance(node.func, ast.Name) else _describe(node.func)
            raise CalculatorError(f"calling {name} is not allowed; functions: {allowed}")
        if node.keywords:
            raise CalculatorError("keyword arguments are not allowed")
        if any(isinstance(arg, ast.Starred) for arg in node.args):
            raise CalculatorError("*arguments are not allowed")
        name = node.func.id
        func, least, most = FUNCTIONS[name]
        if not least <= len(node.args) <= most:
            raise CalculatorError(
                f"{name}() takes {least}{'' if least == most else f' to {most}'} argument(s)"
            )
        args = [self.visit(arg) for arg in node.args]
        try:
            return _checked(func(*args))
        except (ValueError, TypeError) as exc:
            if isinstance(exc, CalculatorError):
                raise
            raise CalculatorError(
                f"{name}() is undefined for {', '.join(format_number(a) for a in args)}"
            ) from None


def _digits(value: int) -> int:
    # bit_length is O(1); 0.30103 ≈ log10(2).
    return int(abs(value).bit_length() * 0.30103) + 1


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log10(abs(base)) > MAX_INT_DIGITS:
            raise CalculatorError("the result is too large")
        return _checked(base**exponent)
    if base == 0 and exponent < 0:
        raise ZeroDivisionError
    fbase, fexp = float(base), float(exponent)
    if fbase < 0 and not fexp.is_integer():
        raise CalculatorError("a negative number to a fractional power is not a real number")
    if abs(fbase) > 1 and fexp * math.log10(abs(fbase)) > 300:
        raise CalculatorError("the result is too large")
    return _checked(base**exponent)


def _checked(value: Any) -> Number:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, int):
        if value and _digits(value) > MAX_INT_DIGITS + 1:
            raise CalculatorError("the result is too large")
        return value
    if math.isnan(value) or math.isinf(value) or abs(value) > MAX_FLOAT:
        raise CalculatorError("the result is too large or not a number")
    return value


def _describe(node: ast.AST) -> str:
    names = {
        ast.Attribute: "attribute access",
        ast.Subscript: "indexing",
        ast.Lambda: "a lambda",
        ast.Compare: "a comparison",
        ast.BoolOp: "and/or",
        ast.IfExp: "if/else",
        ast.Dict: "a dict",
        ast.List: "a list",
        ast.Tuple: "a tuple",
        ast.Set: "a set",
        ast.ListComp: "a comprehension",
        ast.GeneratorExp: "a generator",
        ast.NamedExpr: "an assignment",
        ast.JoinedStr: "an f-string",
    }
    return names.get(type(node), type(node).__name__)

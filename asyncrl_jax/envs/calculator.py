"""A safe arithmetic evaluator for the calculator tool: the expression is parsed (``ast``), never
evaluated as Python, and only numbers, + - * / // % **, unary signs and parentheses are allowed.
Limits keep a hostile expression cheap: its length, the size of every intermediate integer, and the
exponent of ``**``."""

from __future__ import annotations

import ast
import operator

MAX_CHARS = 1000
MAX_DIGITS = 4000  # of any intermediate integer
MAX_EXPONENT = 1000

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
  """The expression is not allowed or cannot be computed (the message says why)."""


def _check(value):
  if isinstance(value, int) and abs(value).bit_length() > MAX_DIGITS * 3.33:
    raise CalculatorError(f"a result longer than {MAX_DIGITS} digits")
  return value


def _eval(node):
  if isinstance(node, ast.Expression):
    return _eval(node.body)
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return _check(node.value)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_eval(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _eval(node.left), _eval(node.right)
    if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
      raise CalculatorError(f"an exponent above {MAX_EXPONENT}")
    try:
      return _check(_BINARY[type(node.op)](left, right))
    except ZeroDivisionError:
      raise CalculatorError("division by zero") from None
    except OverflowError:
      raise CalculatorError("a result too large for a float") from None
  raise CalculatorError(f"{type(node).__name__} is not allowed (numbers, + - * / // % ** and "
                        "parentheses only)")


def calculate(expression: str) -> str:
  """The value of ``expression`` as text (integers exactly; floats as Python prints them)."""
  if len(expression) > MAX_CHARS:
    raise CalculatorError(f"an expression longer than {MAX_CHARS} characters")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except SyntaxError as e:
    raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None
  value = _eval(tree)
  if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
    return str(int(value))
  return str(value)

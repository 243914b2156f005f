"""A safe arithmetic evaluator for the calculator tool: the expression is parsed (``ast``), never
evaluated as Python, and only numbers, + - * / // % **, unary signs and parentheses are allowed.

Every operation is bounded before it runs, from its operands' sizes, so a hostile expression costs
microseconds, not seconds of big-integer work that would hold the GIL: a product's bit length is at
most the sum of its operands', a power's at least ``(bits(base) - 1) * exponent``; an integer result
is kept below ``MAX_BITS`` (about 4000 decimal digits). The expression's length and nesting depth are
bounded before it is parsed. Every failure, whatever raised it, is a ``CalculatorError`` naming why:
the tool answers it as an error and the episode goes on."""

from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 1000
MAX_DIGITS = 4000  # of any intermediate integer
MAX_BITS = int(MAX_DIGITS * math.log2(10)) + 1
MAX_DEPTH = 100  # of nested operations and parentheses

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
  """The expression is not allowed or cannot be computed (the message says why)."""


def _bits(x) -> int:
  return abs(x).bit_length() if isinstance(x, int) else 0


def _bound(op, left, right) -> None:
  """Refuses ``left op right`` before it is computed when its integer result would pass MAX_BITS."""
  too_long = CalculatorError(f"a result longer than {MAX_DIGITS} digits")
  if not (isinstance(left, int) and isinstance(right, int)):
    return  # a float result: at most 64 bits, an overflow raises
  if op is ast.Mult and _bits(left) + _bits(right) > MAX_BITS + 1:
    raise too_long
  if op is ast.Pow and right > 0 and _bits(left) > 1:
    if right > MAX_BITS or (_bits(left) - 1) * right >= MAX_BITS:
      raise too_long


def _real(value):
  if isinstance(value, complex):
    raise CalculatorError("not a real number (a fractional power of a negative number)")
  if isinstance(value, float) and not math.isfinite(value):
    raise CalculatorError("a result too large for a float")
  if isinstance(value, int) and _bits(value) > MAX_BITS:
    raise CalculatorError(f"a result longer than {MAX_DIGITS} digits")
  return value


def _depth(tree) -> int:
  """The nesting depth of ``tree``, walked without recursion."""
  deepest, stack = 0, [(tree, 1)]
  while stack:
    node, d = stack.pop()
    deepest = max(deepest, d)
    stack.extend((child, d + 1) for child in ast.iter_child_nodes(node))
  return deepest


def _eval(node):
  if isinstance(node, ast.Expression):
    return _eval(node.body)
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return _real(node.value)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_eval(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _eval(node.left), _eval(node.right)
    _bound(type(node.op), left, right)
    try:
      return _real(_BINARY[type(node.op)](left, right))
    except ZeroDivisionError:
      raise CalculatorError("division by zero") from None
    except OverflowError:
      raise CalculatorError("a result too large for a float") from None
  raise CalculatorError(f"{type(node).__name__} is not allowed (numbers, + - * / // % ** and "
                        "parentheses only)")


def calculate(expression: str) -> str:
  """The value of ``expression`` as text (integers exactly; floats as Python prints them)."""
  if not isinstance(expression, str):
    raise CalculatorError(f"an expression must be text, not {type(expression).__name__}")
  if len(expression) > MAX_CHARS:
    raise CalculatorError(f"an expression longer than {MAX_CHARS} characters")
  # the parser recurses per nesting level: count the levels an expression can open first
  if sum(expression.count(c) for c in "(-+~") > MAX_DEPTH * 2:
    raise CalculatorError(f"more than {MAX_DEPTH * 2} parentheses and signs")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except SyntaxError as e:
    raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None
  except (RecursionError, MemoryError, ValueError) as e:
    raise CalculatorError(f"not an arithmetic expression ({type(e).__name__})") from None
  if _depth(tree) > MAX_DEPTH:
    raise CalculatorError(f"nested more than {MAX_DEPTH} deep")
  try:
    value = _eval(tree)
  except CalculatorError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (whatever it is, a tool error, not a crash)
    raise CalculatorError(f"cannot be computed ({type(e).__name__}: {e})"[:200]) from None
  if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
    return str(int(value))
  return str(value)

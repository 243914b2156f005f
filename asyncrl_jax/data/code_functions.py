"""The built-in code task: write the program that computes a function shown by examples.

A problem is a hidden function ``f(x) = a*x + b`` (``a`` in 1..9, ``b`` in -9..9), shown by its values
at ``x = 1, 2, 3``; the answer is a Python program that reads ``x`` and prints ``f(x)``, scored on
hidden tests (``TESTS`` values of ``x`` up to 99, none of them shown; the shown ones are the public
tests, run too) by running it in the sandbox (``rl.rewards.code_reward``). The worked solution infers ``a`` and ``b`` from the examples, then
writes the program::

  prompt:    1:5,2:8,3:11?
  solution:  8-5=3;5-3=2;```python
             x=int(input())
             print(3*x+2)
             ```

(a negative ``b`` is written ``print(3*x-2)``). A program that prints the examples' values, or
guesses the pattern from one of them, fails the hidden tests.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

TESTS = 4  # hidden tests per problem
SHOWN = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class Problem:
  question: str  # "1:5,2:8,3:11?"
  answer: str  # the hidden tests' JSON (envs.code_tests form)
  solution: str  # the worked solution
  num_terms: int  # (the schema's field: the number of examples shown)


def program(a: int, b: int) -> str:
  """The program for ``a*x + b``, as the solution writes it."""
  term = "" if b == 0 else f"+{b}" if b > 0 else f"-{-b}"
  return f"x=int(input())\nprint({a}*x{term})"


def make_problem(rng: np.random.Generator) -> Problem:
  a, b = int(rng.integers(1, 10)), int(rng.integers(-9, 10))
  f = lambda x: a * x + b  # noqa: E731
  question = ",".join(f"{x}:{f(x)}" for x in SHOWN) + "?"
  hidden = [int(x) for x in rng.choice(np.arange(4, 100), size=TESTS, replace=False)]
  # the shown examples are the public tests (first), the rest hidden; the reward runs them all
  tests = {"stdin": [{"input": f"{x}\n", "output": f"{f(x)}\n"} for x in (*SHOWN, *hidden)],
           "public": len(SHOWN)}
  # the worked steps: a from the first difference, b from the first example
  steps = f"{f(2)}-{f(1)}={a};{f(1)}-{a}={b};"
  solution = f"{steps}```python\n{program(a, b)}\n```"
  return Problem(question, json.dumps(tests), solution, len(SHOWN))

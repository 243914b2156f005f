"""The built-in agentic task: sums of multi-digit numbers, where a calculator call pays off.

A problem sums ``k`` numbers of 1 to ``max_digits`` digits; a small model cannot add such numbers
reliably in its own chain of thought, but it can copy them into a calculator call and copy the
result out (``envs.tools_env`` with the ``ToolTokenizer``'s markers)::

  prompt:    123+4567+89=
  solution:  [123+4567+89]{4779}#4779     ({4779} is the calculator's answer: an observation)

The reward is exact, as in the chain-of-thought task: 1 when the text after the last ``#`` is the sum.
Demonstrations cover short sums only (``data.demo_max_terms``); RL trains and is evaluated on longer
ones (``data.min_terms``..``data.max_terms``).
"""

from __future__ import annotations

import numpy as np

from asyncrl_jax.data.arithmetic import Problem

CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE = "[", "]", "{", "}"
# the environment options that match the markers above (``env.options`` of configs/tool_use.py)
# (a failed call's output is empty: the vocabulary has no letters to say why)
ENV_OPTIONS = dict(tool="calculator", call_open=CALL_OPEN, call_close=CALL_CLOSE,
                   result_open=RESULT_OPEN, result_close=RESULT_CLOSE, error_output="")


def make_problem(rng: np.random.Generator, min_terms: int = 2, max_terms: int = 4,
                 max_digits: int = 4) -> Problem:
  if not 2 <= min_terms <= max_terms or max_digits < 1:
    raise ValueError(f"need 2 <= min_terms <= max_terms and max_digits >= 1, got {min_terms}, "
                     f"{max_terms}, {max_digits}")
  k = int(rng.integers(min_terms, max_terms + 1))
  numbers = [int(rng.integers(0, 10 ** int(rng.integers(1, max_digits + 1)))) for _ in range(k)]
  expression = "+".join(map(str, numbers))
  total = sum(numbers)
  solution = f"{CALL_OPEN}{expression}{CALL_CLOSE}{RESULT_OPEN}{total}{RESULT_CLOSE}#{total}"
  return Problem(expression + "=", str(total), solution, k)

"""The built-in verifiable task: chain-of-thought addition with heavy-tailed reasoning length.

A problem sums ``k`` single digits; ``k = round(lognormal(ln 3, 0.55))`` truncated to
``[min_terms, max_terms]``, so most chains are short and a few are long, the shape of reasoning traces
(DESIGN.md section 8). Prompt and worked solution::

  prompt:    3+4+5+1=
  solution:  3+4=7;7+5=12;12+1=13;#13

The reward is exact: 1 when the text after the last ``#`` is the sum, else 0.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

LOG_MEDIAN_TERMS = math.log(3.0)
SIGMA_TERMS = 0.55


@dataclasses.dataclass(frozen=True)
class Problem:
  question: str  # "3+4+5="
  answer: str  # "12"
  solution: str  # "3+4=7;7+5=12;#12"
  num_terms: int


def sample_num_terms(rng: np.random.Generator, min_terms: int = 2, max_terms: int = 16) -> int:
  if not 2 <= min_terms <= max_terms:
    raise ValueError(f"need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
  k = int(round(rng.lognormal(LOG_MEDIAN_TERMS, SIGMA_TERMS)))
  return min(max(k, min_terms), max_terms)


def make_problem(rng: np.random.Generator, min_terms: int = 2, max_terms: int = 16) -> Problem:
  k = sample_num_terms(rng, min_terms, max_terms)
  digits = [int(d) for d in rng.integers(0, 10, size=k)]
  steps, total = [], digits[0]
  for d in digits[1:]:
    steps.append(f"{total}+{d}={total + d}")
    total += d
  question = "+".join(map(str, digits)) + "="
  return Problem(question, str(total), ";".join(steps) + f";#{total}", k)


def reward(completion: str, answer: str) -> float:
  """1.0 iff the final answer (text after the last '#') equals ``answer`` exactly."""
  if "#" not in completion:
    return 0.0
  return float(completion.rsplit("#", 1)[1] == answer)

"""The figures of a held-out evaluation: the sampling key of each version's evaluation, and pass
rates with their standard errors over problems. Shared by the single-turn and the episode evaluators."""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np


def eval_key(seed: int, version: Optional[int]) -> jax.Array:
  """The sampling key of the evaluation of policy ``version`` in a run seeded ``seed``."""
  key = jax.random.key(seed)
  return key if version is None else jax.random.fold_in(key, version)


def standard_error(per_problem: np.ndarray) -> float:
  """The standard error of a mean over problems (sample sd / sqrt(n); 0 for fewer than 2)."""
  per_problem = np.asarray(per_problem, np.float64)
  if per_problem.size < 2:
    return 0.0
  return float(per_problem.std(ddof=1) / np.sqrt(per_problem.size))


def figures(greedy: np.ndarray, sampled: Optional[np.ndarray], samples: int) -> dict:
  """The evaluation's figures from its rewards: greedy per problem, sampled problem-major
  (``samples`` per problem; None: not sampled), each mean with its standard error over problems."""
  out = {"greedy": float(np.mean(greedy)), "greedy_se": standard_error(greedy),
         "sampled": None, "sampled_se": None}
  if sampled is not None:
    per_problem = np.asarray(sampled, np.float64).reshape(-1, samples).mean(axis=1)
    out.update(sampled=float(np.mean(sampled)), sampled_se=standard_error(per_problem))
  return out

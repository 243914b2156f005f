"""DAPO's data shaping (Yu et al. 2025) as pure functions; the controller applies them
(``rl.filter_uniform_groups``, ``rl.overlong_penalty_len``)."""

from __future__ import annotations


def uniform(rewards) -> bool:
  """Whether a group's rewards are all equal (its group-relative advantages are all 0)."""
  values = list(rewards)
  return max(values) - min(values) == 0.0 if values else True


def overlong_penalty(length: int, max_new_tokens: int, cache: int) -> float:
  """DAPO's soft overlong penalty: 0 up to ``max_new_tokens - cache`` tokens, then falling linearly
  to -1 at ``max_new_tokens`` (``cache`` = 0: none). Completions never exceed ``max_new_tokens``
  here (the decode server stops them), so DAPO's -1 beyond it does not arise."""
  if cache <= 0:
    return 0.0
  start = max_new_tokens - cache
  return -min(max(length - start, 0), cache) / cache

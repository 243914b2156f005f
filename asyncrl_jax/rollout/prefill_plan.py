"""Batched-prefill planning, as pure functions: which (rows, width) shapes a prefill of several
sequences uses, and how rows of different lengths are grouped into calls so that short sequences are
not padded to the longest one. Used for new prompts and for the re-prefill after a weight update."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from asyncrl_jax.infra import bucketing
from asyncrl_jax.infra.bucketing import PREFILL_BUCKETS


def bucket_length(n: int, max_len: int, buckets: Sequence[int] = PREFILL_BUCKETS) -> int:
  """Width a prefill of ``n`` tokens is padded to: a bucket no wider than ``max_len``, else ``max_len``."""
  return bucketing.bucket(n, buckets, cap=max_len)


def row_bucket(n: int, num_slots: int) -> int:
  """Rows a batched prefill of ``n`` sequences is padded to: a power of four, or ``num_slots`` if that
  is smaller (few compiled shapes, never more rows than the decode state has)."""
  if not 1 <= n <= num_slots:
    raise ValueError(f"{n} rows outside [1, {num_slots}]")
  rows = 1
  while rows < n:
    rows *= 4
  return min(rows, num_slots)


def _within(rows: int, width: int, max_tokens: int) -> bool:
  """Whether one call of ``rows`` x ``width`` keeps under ``max_tokens`` (0: no cap); one row always
  does, or a long sequence could never be prefilled."""
  return not max_tokens or rows == 1 or rows * width <= max_tokens


def prefill_shapes(num_slots: int, max_len: int, max_tokens: int = 0) -> list[tuple[int, int]]:
  """Every (rows, width) shape a batched prefill may use, the covering one (most slots, full width)
  first, then by decreasing rows and width; with ``max_tokens``, only shapes of at most that many
  tokens (and single rows), which bounds a call's activation memory."""
  rows = sorted({row_bucket(n, num_slots) for n in range(1, num_slots + 1)}, reverse=True)
  widths = sorted({bucket_length(n, max_len) for n in range(1, max_len + 1)}, reverse=True)
  return [(r, w) for r in rows for w in widths if _within(r, w, max_tokens)]


def prefill_plan(lengths_s, num_slots: int, max_len: int, call_overhead: int = 256,
                  available: Optional[set] = None,
                  max_tokens: int = 0) -> Optional[list[tuple[np.ndarray, int, int]]]:
  """Splits the rows to prefill (``lengths_s > 0``) into calls that waste the fewest padded tokens.

  Used for the re-prefill of every busy slot after a weight update, and for new prompts. A call
  prefills a group of rows of similar length as ``rows`` x ``width`` tokens. With slots sorted
  by length, the split into contiguous groups minimises the tokens computed (padding included) plus
  ``call_overhead`` tokens per call, by dynamic programming over the split points. One call for all
  slots at the longest one's width, the plain alternative, is one of the candidates.

  Args:
    lengths_s: tokens held by each slot (0: idle).
    num_slots: slots in the decode state.
    max_len: cache length (the widest width).
    call_overhead: what one more call costs, in prefilled tokens.
    available: if given, only these ``(rows, width)`` shapes may be used (e.g. the compiled ones), a
      group of ``k`` slots going into the cheapest shape with ``rows >= k`` and a wide enough width;
      otherwise ``rows = row_bucket(k)`` and ``width = bucket_length(longest)``.
    max_tokens: no call computes more than this many tokens unless it is a single row (0: no cap).

  Returns:
    [(slot indices, rows, width)], longest group first, every busy slot in exactly one group; None if
    the ``available`` shapes cannot hold every busy slot.
  """
  lengths_s = np.asarray(lengths_s)
  busy = np.flatnonzero(lengths_s > 0)
  if not len(busy):
    return []
  order = busy[np.argsort(-lengths_s[busy], kind="stable")]
  needs = [bucket_length(int(lengths_s[i]), max_len) for i in order]
  n = len(order)
  shape_for = {}  # width needed -> [cheapest (cost, rows, width) for k = 0..n slots, or None]
  for need in set(needs):
    if available is None:
      shape_for[need] = [None] + [(row_bucket(k, num_slots) * need, row_bucket(k, num_slots), need)
                                  if _within(row_bucket(k, num_slots), need, max_tokens) else None
                                  for k in range(1, n + 1)]
    else:
      fits = [(r * w, r, w) for r, w in available if w >= need and _within(r, w, max_tokens)]
      shape_for[need] = [None] + [min((f for f in fits if f[1] >= k), default=None)
                                  for k in range(1, n + 1)]
  best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j slots (in sorted order)
  choice = [None] * (n + 1)
  for j in range(1, n + 1):
    for i in range(j):  # the group is order[i:j]; the widest slot in it is order[i]
      shape = shape_for[needs[i]][j - i]
      if shape is not None and best[i] + shape[0] + call_overhead < best[j]:
        best[j], choice[j] = best[i] + shape[0] + call_overhead, (i, shape[1], shape[2])
  if choice[n] is None:
    return None
  groups, j = [], n
  while j:
    i, rows, width = choice[j]
    groups.append((order[i:j], rows, width))
    j = i
  return groups[::-1]


def plan_tokens(plan) -> int:
  """Tokens a plan computes, padding included."""
  return sum(rows * width for _, rows, width in plan)

"""Length buckets: the few static shapes that variable lengths are padded to, so jit compiles a
handful of programs instead of one per length; ``bounded_traces`` makes a jitted function fail
loudly when it is traced for more shapes than that. Shared by the learner's packing (``rl.batching``) and
the decode server's prefills (``rollout.prefill_plan``)."""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import chex

# Rows of the learner's packed micro-batches.
ROW_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# Widths of batched prefills (prompts are often shorter than training rows).
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class BucketError(ValueError):
  """A length fits no bucket."""


def bucket(n: int, buckets: Sequence[int], *, cap: Optional[int] = None) -> int:
  """The smallest bucket ``>= n``; with ``cap``, buckets above it are skipped and ``cap`` itself is
  the last resort (a cache of ``cap`` tokens is the widest shape there is).

  Raises:
    BucketError: ``n`` exceeds ``cap``, or the largest bucket when there is no cap.
  """
  for b in buckets:
    if b >= n and (cap is None or b <= cap):
      return b
  if cap is not None and n <= cap:
    return cap
  raise BucketError(f"length {n} exceeds {cap}" if cap is not None
                    else f"length {n} exceeds the largest bucket {buckets[-1]}")


_instances = itertools.count()


def bounded_traces(fn, name: str, n: int):
  """``chex.assert_max_traces(fn, n)`` counted for this one function object: the wrapped function
  raises ``AssertionError`` when traced an ``n + 1``-th time (a shape the bucketing does not allow, or
  a placement that changed). chex keys its counter by where and how a function is defined, which
  every instance of a class shares; a name unique to the process keeps one instance's traces from
  counting against another's."""
  fn.__name__ = f"{name}#{next(_instances)}"
  return chex.assert_max_traces(fn, n=n)

"""Leaving a process at once, without interpreter shutdown, and without leaving children behind.

The train job and the decode servers end with ``os._exit`` once their work is written: interpreter
shutdown can abort on a native thread still running (XLA's, gRPC's, a tokenizer's). ``os._exit`` also
skips the shutdown of process pools, so a pool's worker (the math reward's, spawned) would outlive its
parent, keep the parent's stdout and stderr open, and hang whoever reads them to the end (a test's
``subprocess.run``, a shell pipe). ``now`` kills the multiprocessing children first.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys

from absl import logging as absl_logging


def kill_children(wait: float = 5.0) -> int:
  """Kills every live multiprocessing child of this process and waits up to ``wait`` seconds for
  each; returns how many there were."""
  children = multiprocessing.active_children()
  for child in children:
    child.kill()
  for child in children:
    child.join(wait)
  return len(children)


def now(code: int) -> None:
  """Flushes the logs and streams, kills the multiprocessing children, and exits with ``code``."""
  absl_logging.flush()
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  kill_children()
  os._exit(code)  # pylint: disable=protected-access

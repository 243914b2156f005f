"""Pathological reward functions for ``test_data.py`` (importable by spawned reward workers)."""

import os


def hog(completion: str, answer: str) -> float:
  """Tries to hold 64 GiB: a MemoryError under the reward worker's cap."""
  del completion, answer
  blocks = [bytearray(2 ** 30) for _ in range(64)]
  return float(len(blocks))


def die(completion: str, answer: str) -> float:
  """The worker process exits mid-call."""
  del completion, answer
  os._exit(3)


def exact(completion: str, answer: str) -> float:
  return float(completion.strip() == answer.strip())

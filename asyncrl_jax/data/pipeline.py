"""Prompt pipeline: a TFDS array_record split read through grain (shuffle, shard by process, repeat).

The controller draws prompts one at a time; ``PromptStream`` numbers them (a global prompt index) and
remembers grain's iterator state at any index it is asked to, so a checkpoint can store exactly where
the first untrained prompt starts: on resume nothing is skipped and nothing is repeated.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional

import grain
import jax


@dataclasses.dataclass(frozen=True)
class Prompt:
  index: int  # position in this run's prompt stream (0, 1, 2, ...)
  question: str
  answer: str
  solution: str

  @property
  def digest(self) -> str:
    """A short hash of the question: which problem this is, whatever its position in the stream."""
    return hashlib.sha1(self.question.encode()).hexdigest()[:12]


def _text(x) -> str:
  return x.decode() if isinstance(x, bytes) else str(x)


class PromptStream:
  """Shuffled, repeated prompts with checkpointable position, sharded over ``shard_count`` readers
  (default: one per process; the main job's single controller reads them all, ``shard_count=1``)."""

  def __init__(self, data_source, *, seed: int, shard_index: Optional[int] = None,
               shard_count: Optional[int] = None):
    shard_index = jax.process_index() if shard_index is None else shard_index
    shard_count = jax.process_count() if shard_count is None else shard_count
    ds = grain.MapDataset.source(data_source)[shard_index::shard_count]
    ds = ds.shuffle(seed=seed).repeat()
    self._iter = iter(ds.to_iter_dataset())
    self.next_index = 0

  def get_state(self) -> dict:
    """State to resume so that the next prompt drawn is ``next_index``."""
    return {"next_index": self.next_index, "grain": self._iter.get_state()}

  def set_state(self, state: dict) -> None:
    self._iter.set_state(state["grain"])
    self.next_index = int(state["next_index"])

  def next(self) -> Prompt:
    record = next(self._iter)
    prompt = Prompt(self.next_index, _text(record["question"]), _text(record["answer"]),
                    _text(record.get("solution", b"")))
    self.next_index += 1
    return prompt


def read_split(builder, split: str, limit: Optional[int] = None) -> list[dict]:
  """All (or the first ``limit``) records of a split, decoded to str (for evaluation)."""
  source = builder.as_data_source(split=split)
  n = len(source) if limit is None else min(limit, len(source))
  return [{k: (_text(v) if isinstance(v, bytes) else v) for k, v in source[i].items()} for i in range(n)]

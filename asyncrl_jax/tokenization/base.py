"""The tokenizer interface every component uses (engine, controller, data pipeline)."""

from __future__ import annotations

import abc
from typing import Optional, Sequence


class TokenizerError(ValueError):
  """Text or a tokenizer file that cannot be handled exactly."""


class Tokenizer(abc.ABC):
  """Maps text to token ids and back; ``encode_prompt`` applies the chat template.

  ``identity`` names the vocabulary and template (recorded with every trajectory, so a log-prob is
  never compared across tokenizers).
  """

  vocab_size: int
  pad_id: int
  eos_id: int
  bos_id: Optional[int]
  identity: str

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """Token ids of ``text`` with no special tokens added."""

  @abc.abstractmethod
  def decode(self, ids: Sequence[int]) -> str:
    """Text of ``ids``; special tokens are dropped."""

  @abc.abstractmethod
  def encode_prompt(self, question: str) -> list[int]:
    """Token ids of a user turn ``question`` followed by the start of the assistant's answer."""

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)

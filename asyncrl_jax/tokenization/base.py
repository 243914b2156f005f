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

  def encode_chat(self, messages: list) -> list[int]:
    """Token ids of a conversation (``[{"role", "content"}, ...]``) followed by the start of the
    assistant's answer: a chat client's first request."""
    raise TokenizerError(f"{type(self).__name__} has no chat template")

  def encode_chat_continuation(self, history: list, new: list) -> list[int]:
    """Token ids of messages ``new`` after ``history`` (whose last message is the assistant's),
    followed by the start of the next answer: what a chat client's next request adds to the
    context the policy already holds."""
    raise TokenizerError(f"{type(self).__name__} has no chat template")

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)

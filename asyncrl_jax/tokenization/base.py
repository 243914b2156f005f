"""The tokenizer interface every component uses (engine, controller, data pipeline)."""

from __future__ import annotations

import abc
import json
import re
from typing import Optional, Sequence

# the Qwen2.5 / Hermes tool-call format: a JSON object {"name", "arguments"} between these markers
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.S)


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

  # stop sequences that end an action holding a tool call, where the end of sequence does not (the
  # built-in vocabulary's ``]``); a chat format whose calls end with the message needs none
  tool_call_stop: tuple = ()

  def encode_chat(self, messages: list, tools: Optional[list] = None) -> list[int]:
    """Token ids of a conversation (``[{"role", "content"}, ...]``, OpenAI's messages: assistant
    messages may carry ``tool_calls``, ``role: "tool"`` messages answer them) followed by the start
    of the assistant's answer, with ``tools`` (OpenAI function schemas) where the template shows
    them: a chat client's first request."""
    raise TokenizerError(f"{type(self).__name__} has no chat template")

  def encode_chat_continuation(self, history: list, new: list, tools: Optional[list] = None) -> list[int]:
    """Token ids of messages ``new`` after ``history`` (whose last message is the assistant's),
    followed by the start of the next answer: what a chat client's next request adds to the
    context the policy already holds."""
    raise TokenizerError(f"{type(self).__name__} has no chat template")

  def parse_tool_calls(self, text: str) -> tuple[str, list]:
    """``(content, calls)`` of an action: the Qwen2.5 / Hermes format, ``<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>`` blocks, each call ``{"name", "arguments"}`` (``arguments`` a
    dict), the content the text outside them. A block that is not such an object stays in the
    content (the client sees what the policy wrote)."""
    calls, kept, at = [], [], 0
    for m in _TOOL_CALL.finditer(text):
      try:
        call = json.loads(m.group(1))
      except json.JSONDecodeError:
        continue
      if not (isinstance(call, dict) and isinstance(call.get("name"), str)
              and isinstance(call.get("arguments", {}), dict)):
        continue
      calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
      kept.append(text[at:m.start()])
      at = m.end()
    kept.append(text[at:])
    return "".join(kept).strip(), calls

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)

"""Character tokenizers of the built-in tasks.

``ArithmeticTokenizer`` (17 tokens, ``""``): digits and ``+ = ; #``. A prompt is ``<bos>3+4+5=`` and a
completion is a chain of partial sums ``3+4=7;7+5=12;#12<eos>``.

``ToolTokenizer`` (21 tokens, ``"builtin:tools"``): the same and the tool markers ``[ ] { }``: a
calculator call ``[123+4567]``, its result ``{4690}`` (an observation), then ``#4690<eos>``.
"""

from __future__ import annotations

import json
from typing import Sequence

from asyncrl_jax.tokenization.base import Tokenizer, TokenizerError

PAD, BOS, EOS = 0, 1, 2
_CHARS = "0123456789+=;#"


class ArithmeticTokenizer(Tokenizer):
  """ids: 0 pad, 1 bos, 2 eos, then one id per character of ``0123456789+=;#``."""

  chars = _CHARS
  vocab_size = 3 + len(_CHARS)
  pad_id, bos_id, eos_id = PAD, BOS, EOS
  identity = "builtin-arithmetic-v1"

  def __init__(self):
    self._to_id = {ch: 3 + i for i, ch in enumerate(self.chars)}

  def encode(self, text: str) -> list[int]:
    try:
      return [self._to_id[ch] for ch in text]
    except KeyError as e:
      raise TokenizerError(f"character {e.args[0]!r} is not in the built-in vocabulary {self.chars!r}") \
          from None

  def decode(self, ids: Sequence[int]) -> str:
    out = []
    for i in ids:
      i = int(i)
      if not 0 <= i < self.vocab_size:
        raise TokenizerError(f"token id {i} is outside the built-in vocabulary [0, {self.vocab_size})")
      if i >= 3:
        out.append(self.chars[i - 3])
    return "".join(out)

  def encode_prompt(self, question: str) -> list[int]:
    return [BOS] + self.encode(question)

  # The built-in chat template: <bos>, then every message's content as it is (an assistant message
  # ends where the policy's action ended); no roles, no generation prompt. A conversation of one user
  # message is the task's prompt.
  def encode_chat(self, messages: list, tools=None) -> list[int]:
    return [BOS] + self.encode_chat_continuation([], messages, tools)

  def encode_chat_continuation(self, history: list, new: list, tools=None) -> list[int]:
    del history, tools
    return [t for m in new for t in self.encode(self._message_text(m))]

  def _message_text(self, m: dict) -> str:
    return str(m.get("content") or "")


class ToolTokenizer(ArithmeticTokenizer):
  """The arithmetic vocabulary and the tool markers: ids 17-20 are ``[ ] { }``.

  Its chat format, the built-in form of standard tool calls (the vocabulary cannot spell JSON): an
  action ending ``[args]`` calls the conversation's one tool with ``args`` as its one string argument
  (``parse_tool_calls`` gives ``{"name": None, "arguments": args}``, and ``]`` ends such an action); an
  assistant message with a tool call renders as its content then ``[args]``; a ``tool`` message as
  ``{content}``."""

  chars = _CHARS + "[]{}"
  vocab_size = 3 + len(chars)
  identity = "builtin-tools-v1"
  tool_call_stop = ("]",)

  def parse_tool_calls(self, text: str) -> tuple[str, list]:
    start = text.rfind("[")
    if start < 0 or not text.endswith("]"):
      return text, []
    return text[:start], [{"name": None, "arguments": text[start + 1:-1]}]

  def _message_text(self, m: dict) -> str:
    if m.get("role") == "tool":
      return "{" + str(m.get("content") or "") + "}"
    text = str(m.get("content") or "")
    for call in m.get("tool_calls") or ():
      arguments = (call.get("function") or {}).get("arguments", "")
      try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
      except json.JSONDecodeError:
        value = arguments
      if isinstance(value, dict) and len(value) == 1:  # the one argument, as the policy wrote it
        value = next(iter(value.values()))
      text += f"[{value}]"
    return text

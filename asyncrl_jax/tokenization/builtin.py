"""Character tokenizers of the built-in tasks.

``ArithmeticTokenizer`` (17 tokens, ``""``): digits and ``+ = ; #``. A prompt is ``<bos>3+4+5=`` and a
completion is a chain of partial sums ``3+4=7;7+5=12;#12<eos>``.

``ToolTokenizer`` (21 tokens, ``"builtin:tools"``): the same and the tool markers ``[ ] { }``: a
calculator call ``[123+4567]``, its result ``{4690}`` (an observation), then ``#4690<eos>``.

``CodeTokenizer`` (30 tokens, ``"builtin:code"``): the built-in code task's (``data.code_functions``)
characters ``0-9 + - * = ; : , ? x ( )`` and newline, and four pieces of Python as one token each
(```` ```python\n ````, ``x=int(input())\n``, ``print(``, ```` \n``` ````): a prompt
``<bos>1:5,2:8,3:11?``, a completion ``8-5=3;5-3=2;```python\nx=int(input())\nprint(3*x+2)\n```<eos>``.

``CodeToolTokenizer`` (32 tokens, ``"builtin:code_tools"``): the same and ``{ }``, around what the
coding agent's environment answers (``envs.code_env``: the failing public tests, ``{2:9}``).
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


class CodeTokenizer(ArithmeticTokenizer):
  """ids: 0 pad, 1 bos, 2 eos, then ``PIECES`` (longest match first when encoding; decoding, the
  prompt and the chat format as the arithmetic tokenizer's, over these pieces)."""

  PIECES = ("0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+", "-", "*", "=", ";", ":", ",", "?", "x",
            "(", ")", "\n", "```python\n", "x=int(input())\n", "print(", "\n```", " ")
  chars = PIECES
  vocab_size = 3 + len(PIECES)
  identity = "builtin-code-v1"

  def __init__(self):
    super().__init__()
    self._by_length = sorted(self.chars, key=len, reverse=True)

  def encode(self, text: str) -> list[int]:
    ids, i = [], 0
    while i < len(text):
      piece = next((p for p in self._by_length if text.startswith(p, i)), None)
      if piece is None:
        raise TokenizerError(f"{text[i:i + 10]!r} (at character {i}) is not in the built-in code vocabulary")
      ids.append(self._to_id[piece])
      i += len(piece)
    return ids


class CodeToolTokenizer(CodeTokenizer):
  """The built-in code vocabulary and ``{ }`` (ids 30-31), around what the coding agent's environment
  (``envs.code_env``) answers: the failing public tests, ``{2:9}``."""

  PIECES = CodeTokenizer.PIECES + ("{", "}")
  chars = PIECES
  vocab_size = 3 + len(PIECES)
  identity = "builtin-code-tools-v1"

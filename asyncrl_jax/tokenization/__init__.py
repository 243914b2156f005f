"""Tokenizers: Hugging Face ``tokenizer.json`` (+ chat template) and the built-in tasks' tokenizers."""

import json
from typing import Optional

from asyncrl_jax.tokenization.base import Tokenizer, TokenizerError
from asyncrl_jax.tokenization.builtin import ArithmeticTokenizer, CodeTokenizer, CodeToolTokenizer, ToolTokenizer
from asyncrl_jax.tokenization.hf import HFTokenizer

BUILTIN = {"": ArithmeticTokenizer, "builtin:tools": ToolTokenizer, "builtin:code": CodeTokenizer,
           "builtin:code_tools": CodeToolTokenizer}


def load_tokenizer(path: str = "", *, template_kwargs: Optional[dict] = None) -> Tokenizer:
  """The built-in tokenizer named ``path`` (``""``: arithmetic, ``"builtin:tools"``: arithmetic and
  tool markers, ``"builtin:code"``: the built-in code task's, ``"builtin:code_tools"``: and the coding agent's
  observation markers), else ``HFTokenizer(path, template_kwargs=...)`` for a directory with
  tokenizer.json (``template_kwargs``: what its chat template gets beside the messages)."""
  if path in BUILTIN:
    if template_kwargs:
      raise TokenizerError(f"chat template arguments {sorted(template_kwargs)} given for the built-in "
                           f"tokenizer {path or 'builtin'!r}, which has no chat template")
    return BUILTIN[path]()
  return HFTokenizer(path, template_kwargs=template_kwargs)


def template_kwargs(config) -> dict:
  """``data.chat_template_kwargs`` as a dict (``{}`` when unset); a ``TokenizerError`` naming the
  field when it is not a JSON object or names an argument the template already gets."""
  text = config.data.get("chat_template_kwargs", "")
  if not text:
    return {}
  try:
    value = json.loads(text)
  except ValueError as e:
    raise TokenizerError(f"data.chat_template_kwargs={text!r}: not JSON ({e})") from None
  if not isinstance(value, dict):
    raise TokenizerError(f"data.chat_template_kwargs={text!r}: must be a JSON object, e.g. "
                         "'{\"enable_thinking\": false}'")
  taken = sorted(set(value) & set(HFTokenizer.TEMPLATE_ARGUMENTS))
  if taken:
    raise TokenizerError(f"data.chat_template_kwargs names {taken}, which the template is given by "
                         "the tokenizer itself")
  return value


def tokenizer_of(config) -> Tokenizer:
  """The run's tokenizer: ``data.tokenizer_path`` with ``data.chat_template_kwargs``."""
  return load_tokenizer(config.data.tokenizer_path, template_kwargs=template_kwargs(config))


__all__ = ["Tokenizer", "TokenizerError", "ArithmeticTokenizer", "CodeTokenizer", "CodeToolTokenizer", "ToolTokenizer", "HFTokenizer",
           "load_tokenizer", "template_kwargs", "tokenizer_of", "BUILTIN"]

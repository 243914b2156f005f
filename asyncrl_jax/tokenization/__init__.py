"""Tokenizers: Hugging Face ``tokenizer.json`` (+ chat template) and the built-in tasks' tokenizers."""

from asyncrl_jax.tokenization.base import Tokenizer, TokenizerError
from asyncrl_jax.tokenization.builtin import ArithmeticTokenizer, CodeTokenizer, CodeToolTokenizer, ToolTokenizer
from asyncrl_jax.tokenization.hf import HFTokenizer

BUILTIN = {"": ArithmeticTokenizer, "builtin:tools": ToolTokenizer, "builtin:code": CodeTokenizer,
           "builtin:code_tools": CodeToolTokenizer}


def load_tokenizer(path: str = "") -> Tokenizer:
  """The built-in tokenizer named ``path`` (``""``: arithmetic, ``"builtin:tools"``: arithmetic and
  tool markers, ``"builtin:code"``: the built-in code task's, ``"builtin:code_tools"``: and the coding agent's
  observation markers), else ``HFTokenizer(path)`` for a directory with tokenizer.json."""
  if path in BUILTIN:
    return BUILTIN[path]()
  return HFTokenizer(path)


__all__ = ["Tokenizer", "TokenizerError", "ArithmeticTokenizer", "CodeTokenizer", "CodeToolTokenizer", "ToolTokenizer", "HFTokenizer",
           "load_tokenizer", "BUILTIN"]

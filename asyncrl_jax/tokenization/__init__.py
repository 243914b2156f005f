"""Tokenizers: Hugging Face ``tokenizer.json`` (+ chat template) and the built-in task's tokenizer."""

from asyncrl_jax.tokenization.base import Tokenizer, TokenizerError
from asyncrl_jax.tokenization.builtin import ArithmeticTokenizer
from asyncrl_jax.tokenization.hf import HFTokenizer


def load_tokenizer(path: str = "") -> Tokenizer:
  """``HFTokenizer(path)`` for a directory with tokenizer.json; the built-in tokenizer for ``""``."""
  return HFTokenizer(path) if path else ArithmeticTokenizer()


__all__ = ["Tokenizer", "TokenizerError", "ArithmeticTokenizer", "HFTokenizer", "load_tokenizer"]

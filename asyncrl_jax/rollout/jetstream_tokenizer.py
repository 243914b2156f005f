"""Our tokenizer behind JetStream's tokenizer interface (used by JetStream's orchestrator when serving)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from asyncrl_jax.rollout.jetstream_compat import tokenizer_api
from asyncrl_jax.rollout.prefill_plan import bucket_length
from asyncrl_jax.tokenization import Tokenizer


class JetStreamTokenizer(tokenizer_api.Tokenizer):
  """Adapts our tokenizer to JetStream's tokenizer interface (encode pads to a prefill bucket)."""

  def __init__(self, tokenizer: Tokenizer, max_prefill_length: int):
    self._tok = tokenizer
    self._max = max_prefill_length

  def encode(self, s: str, **kwargs):
    ids = self._tok.encode_prompt(s) if kwargs.get("is_bos", True) else self._tok.encode(s)
    max_len = kwargs.get("max_prefill_length") or self._max
    if len(ids) > max_len:
      raise ValueError(f"prompt has {len(ids)} tokens, more than max_prefill_length={max_len}")
    padded = bucket_length(len(ids), max_len)
    out = np.full(padded, self._tok.pad_id, np.int32)
    out[:len(ids)] = ids
    return (jnp.asarray(out) if kwargs.get("jax_padding", True) else out), len(ids)

  def decode(self, token_ids, **kwargs):
    return self._tok.decode(token_ids)

  @property
  def pad_id(self) -> int:
    return self._tok.pad_id

  @property
  def eos_id(self) -> int:
    return self._tok.eos_id

  @property
  def bos_id(self) -> int:
    return self._tok.bos_id if self._tok.bos_id is not None else self._tok.pad_id

  @property
  def stop_tokens(self) -> set[int]:
    return set(self._tok.stop_ids)

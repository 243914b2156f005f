"""A fused, jitted greedy decode loop: the reference that engines are checked and timed against."""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from asyncrl_jax.models import api
from asyncrl_jax.models.config import ModelConfig


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "eos_id", "mesh"))
def greedy_generate(config: ModelConfig, params, prompt_bp: jax.Array, prompt_len_b: jax.Array, *,
                    max_new_tokens: int, eos_id: int, mesh: Optional[Mesh] = None):
  """Greedy completion of right-padded prompts, in one XLA program.

  Args:
    prompt_bp: int [B, P] prompts, right-padded (padding content is irrelevant).
    prompt_len_b: int [B] true prompt lengths (>= 1).
    max_new_tokens: completion length N; the cache holds P + N positions.
    eos_id: after a row emits it, the row's later tokens are ``eos_id`` too.

  Returns:
    (tokens [B, N], lengths [B]): completion tokens and the number up to and including the first EOS
    (N if none).
  """
  b, p = prompt_bp.shape
  cache = api.init_cache(config, b, p + max_new_tokens)
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  logits, cache = api.apply_decode(config, params, prompt_bp, positions, cache, mesh)
  last = jnp.take_along_axis(logits, (prompt_len_b - 1)[:, None, None], axis=1)[:, 0]
  first = jnp.argmax(last, axis=-1).astype(jnp.int32)

  def step(i, carry):
    tokens, cache, done = carry
    tok = tokens[:, i - 1]
    done = done | (tok == eos_id)
    logits, cache = api.apply_decode(config, params, tok[:, None], (prompt_len_b + i - 1)[:, None],
                                     cache, mesh)
    nxt = jnp.where(done, eos_id, jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32))
    return tokens.at[:, i].set(nxt), cache, done

  tokens = jnp.full((b, max_new_tokens), eos_id, jnp.int32).at[:, 0].set(first)
  tokens, _, _ = jax.lax.fori_loop(1, max_new_tokens, step, (tokens, cache, jnp.zeros(b, bool)))
  is_eos = tokens == eos_id
  lengths = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1) + 1, max_new_tokens)
  return tokens, lengths

"""Fused, jitted decode loops (greedy or sampled): the reference engines are checked and timed against,
and the held-out evaluation."""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from asyncrl_jax.models import api
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.models.sampling import SamplingSettings, sample


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
  return generate(config, params, prompt_bp, prompt_len_b, max_new_tokens=max_new_tokens,
                  eos_id=eos_id, mesh=mesh)


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "eos_id", "mesh", "settings"))
def generate(config: ModelConfig, params, prompt_bp: jax.Array, prompt_len_b: jax.Array, key=None, *,
             max_new_tokens: int, eos_id: int, mesh: Optional[Mesh] = None, settings=None):
  """Like ``greedy_generate``; with ``settings`` (a ``models.sampling.SamplingSettings`` with temperature > 0)
  and a PRNG ``key``, tokens are sampled from the same transformed distribution the engine samples."""
  settings = settings or SamplingSettings(temperature=0.0)
  if settings.temperature > 0 and key is None:
    raise ValueError("sampling needs a PRNG key")
  pick = lambda logits, k: sample(logits, k, settings)[0]  # noqa: E731
  keys = (jax.random.split(key, max_new_tokens) if key is not None else
          jnp.zeros((max_new_tokens,), jnp.uint32))
  b, p = prompt_bp.shape
  cache = api.init_cache(config, b, p + max_new_tokens)
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  # A prefill from position 0 into the cache's rows: attention over the prompts' own tokens ([B, P, P],
  # not against the whole cache's P + N), and next-token logits at each row's last prompt token only
  # ([B, 1, V], not [B, P, V]). Padding's keys beyond a row's length are overwritten by its decode steps
  # before any query reaches them.
  logits, cache = api.apply_decode(config, params, prompt_bp, positions, cache, mesh,
                                   logits_at_b=prompt_len_b - 1, cache_rows_b=jnp.arange(b))
  first = pick(logits[:, 0], keys[0])

  def step(i, carry):
    tokens, cache, done = carry
    tok = tokens[:, i - 1]
    done = done | (tok == eos_id)
    logits, cache = api.apply_decode(config, params, tok[:, None], (prompt_len_b + i - 1)[:, None],
                                     cache, mesh)
    nxt = jnp.where(done, eos_id, pick(logits[:, 0], keys[i]))
    return tokens.at[:, i].set(nxt), cache, done

  tokens = jnp.full((b, max_new_tokens), eos_id, jnp.int32).at[:, 0].set(first)
  tokens, _, _ = jax.lax.fori_loop(1, max_new_tokens, step, (tokens, cache, jnp.zeros(b, bool)))
  is_eos = tokens == eos_id
  lengths = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1) + 1, max_new_tokens)
  return tokens, lengths

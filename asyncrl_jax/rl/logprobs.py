"""Per-token log-probabilities of given tokens under given params (the prox pass, evaluation, the loss).

Alignment: ``logp[b, t] = log p(tokens[b, t] | tokens[b, :t] of the same segment)``; it is computed from
the logits at ``t - 1``. The first token of each segment (and padding, segment 0) has no context and
gets 0: such positions must carry mask 0.

``temperature`` divides the logits first. Behaviour log-probs recorded from the sampling distribution
(``rollout.logprob_source = "sampling"``) are only comparable with log-probs computed at the same
temperature, so the prox pass and the loss use the rollout temperature.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from asyncrl_jax.models import api
from asyncrl_jax.models.config import ModelConfig


def logprobs_from_logits(logits_btv, tokens_bt, segment_ids_bt, *, temperature: float = 1.0,
                         with_entropy: bool = False):
  """Aligned per-token log-probs ``[B, T]`` (and entropies ``[B, T]`` of the predicting distribution)."""
  logits = logits_btv[:, :-1].astype(jnp.float32) / temperature
  targets = tokens_bt[:, 1:]
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  valid = (segment_ids_bt[:, 1:] == segment_ids_bt[:, :-1]) & (segment_ids_bt[:, 1:] > 0)
  pad = jnp.zeros_like(lse[:, :1])
  logp = jnp.concatenate([pad, jnp.where(valid, picked - lse, 0.0)], axis=1)
  if not with_entropy:
    return logp
  probs = jax.nn.softmax(logits, axis=-1)
  entropy = lse - jnp.sum(probs * logits, axis=-1)
  return logp, jnp.concatenate([pad, jnp.where(valid, entropy, 0.0)], axis=1)


def token_logprobs(config: ModelConfig, params, tokens_bt, positions_bt, segment_ids_bt, *,
                   temperature: float = 1.0, mesh: Optional[Mesh] = None, with_entropy: bool = False):
  """Traceable: forward + aligned log-probs (use inside a jitted loss)."""
  logits = api.apply_logits(config, params, tokens_bt, positions_bt, segment_ids_bt, mesh)
  return logprobs_from_logits(logits, tokens_bt, segment_ids_bt, temperature=temperature,
                              with_entropy=with_entropy)


@functools.lru_cache(maxsize=None)
def _jitted(config: ModelConfig, temperature: float, mesh: Optional[Mesh]):
  return jax.jit(functools.partial(token_logprobs, config, temperature=temperature, mesh=mesh))


def compute_logprobs(config: ModelConfig, params, tokens_bt, positions_bt, segment_ids_bt, *,
                     temperature: float = 1.0, mesh: Optional[Mesh] = None) -> jax.Array:
  """One jitted pass: per-token log-probs ``[B, T]`` of ``tokens_bt`` under ``params``.

  Used once per global batch for ``prox_logp`` (with the weights before the update) and for scoring.
  """
  return _jitted(config, float(temperature), mesh)(
      params, jnp.asarray(tokens_bt, jnp.int32), jnp.asarray(positions_bt, jnp.int32),
      jnp.asarray(segment_ids_bt, jnp.int32))

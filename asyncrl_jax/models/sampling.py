"""Token sampling with temperature, top-k and top-p, returning the log-probability of each choice.

Two log-probabilities can be recorded for a sampled token (``rollout.logprob_source``):

* ``"sampling"``: under the distribution actually sampled from: logits / temperature, restricted to the
  top-k and top-p (nucleus) sets and renormalised. This is the behaviour policy in the strict sense.
* ``"model"``: the raw model distribution, ``log_softmax(logits)`` at temperature 1.

With temperature 0 (greedy) the sampling distribution is a point mass, so both sources record the raw
model log-probability. Every trajectory records which source it carries. The learner's log-probs use
the rollout temperature (not top-k / top-p), so with top-k or top-p active the "sampling" source
differs from the learner's by the renormalisation of the truncated set; prefer ``top_k = 0, top_p = 1``
for RL, as AReaL does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_NEG = -1e30


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
  temperature: float = 1.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off
  logprob_source: str = "sampling"  # or "model"

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature}: must be >= 0")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k}: must be >= 0")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
    if self.logprob_source not in ("sampling", "model"):
      raise ValueError(f"logprob_source={self.logprob_source!r}: must be 'sampling' or 'model'")

  @classmethod
  def from_config(cls, config) -> "SamplingSettings":
    """The decode servers' sampling, from the ``rollout`` section of a run config."""
    r = config.rollout
    return cls(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, logprob_source=r.logprob_source)

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def sampling_logits(logits_bv: jax.Array, settings: SamplingSettings) -> jax.Array:
  """The logits of the distribution sampled from (masked entries at -1e30). Needs temperature > 0."""
  logits = logits_bv.astype(jnp.float32) / settings.temperature
  if settings.top_k:
    k = min(settings.top_k, logits.shape[-1])
    kth = jax.lax.top_k(logits, k)[0][:, -1:]
    logits = jnp.where(logits < kth, _NEG, logits)
  if settings.top_p < 1.0:
    sorted_desc = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = mass_before < settings.top_p
    threshold = jnp.min(jnp.where(kept, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, _NEG, logits)
  return logits


def sample(logits_bv: jax.Array, key: jax.Array, settings: SamplingSettings):
  """Samples one token per row. Returns (tokens [B] int32, logp [B] float32)."""
  raw_logp = jax.nn.log_softmax(logits_bv.astype(jnp.float32), axis=-1)
  if settings.temperature == 0:
    tokens = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    return tokens, jnp.take_along_axis(raw_logp, tokens[:, None], axis=-1)[:, 0]
  logits = sampling_logits(logits_bv, settings)
  tokens = jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
  source = jax.nn.log_softmax(logits, axis=-1) if settings.logprob_source == "sampling" else raw_logp
  return tokens, jnp.take_along_axis(source, tokens[:, None], axis=-1)[:, 0]

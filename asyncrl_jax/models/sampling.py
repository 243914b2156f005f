"""Token sampling with temperature, top-k and top-p, returning the log-probability of each choice.

Two log-probabilities can be recorded for a sampled token (``rollout.logprob_source``):

* ``"sampling"``: under the distribution actually sampled from: logits / temperature, restricted to the
  top-k and top-p (nucleus) sets and renormalised. This is the behaviour policy in the strict sense.
* ``"model"``: the raw model distribution, ``log_softmax(logits)`` at temperature 1.

A minimum length (``RolloutRequest.min_new_tokens``, HF's ``min_new_tokens``) holds the stop tokens
back: while a sequence has fewer completion tokens than its minimum, every stop token's logit is
``OUTSIDE`` before anything else (``ban_stop_tokens``), for both sources, so the recorded log-prob is of
the distribution with the ban. The learner applies the same ban at the same tokens (a per-token
``eos_banned`` flag and ``LossSettings.eos_ban_ids``): its log-probs then compare like with like.

With temperature 0 (greedy) the sampling distribution is a point mass, so both sources record the raw
model log-probability. Every trajectory records which source it carries and its settings.

The learner computes its log-probs in the same distribution as the recorded ones
(``SamplingSettings.recorded``): for ``"sampling"`` it applies the same temperature and truncation
(``sampling_logits`` on ``[..., V]`` logits). A token outside the current policy's truncated set has
log-prob ``OUTSIDE`` (``in_support`` is False): the loss gives it weight 0. ``"model"`` at a temperature
other than 0 or 1 records log-probs of a distribution nobody sampled from; the config refuses it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

OUTSIDE = -1e30  # the logit (and, less its normaliser, the log-prob) of a token outside the truncated set


def in_support(logp):
  """Whether each log-prob is of a token inside the truncated set (not ``OUTSIDE``)."""
  return logp > OUTSIDE / 2


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

  def record(self) -> dict:
    """What a trajectory sampled with these settings records of them (``Trajectory.sampling``): the
    settings, with the raw model's log-probs named at temperature 0 (greedy: both sources agree)."""
    return dict(self.as_dict(), logprob_source=self.logprob_source if self.temperature else "model")

  def recorded(self) -> tuple[float, int, float]:
    """``(temperature, top_k, top_p)`` of the distribution the recorded log-probs are in, which the
    learner must use too: these settings for ``"sampling"``, the raw model (1, 0, 1) for ``"model"``
    and for greedy decoding."""
    if self.temperature == 0 or self.logprob_source == "model":
      return 1.0, 0, 1.0
    return float(self.temperature), int(self.top_k), float(self.top_p)


def ban_stop_tokens(logits_v: jax.Array, banned, stop_ids) -> jax.Array:
  """``logits_v`` ``[..., V]`` with the ``stop_ids`` columns at ``OUTSIDE`` where ``banned`` ``[...]``
  (a bool or 0/1 array of the leading shape) is set: the minimum length's stop-token ban."""
  if not len(stop_ids):
    return logits_v
  is_stop = jnp.zeros(logits_v.shape[-1], bool).at[jnp.asarray(stop_ids, jnp.int32)].set(True)
  return jnp.where(is_stop & (jnp.asarray(banned) > 0)[..., None], OUTSIDE, logits_v)


def sampling_logits(logits_v: jax.Array, settings: SamplingSettings) -> jax.Array:
  """The logits ``[..., V]`` of the distribution sampled from (entries outside the truncated set at
  ``OUTSIDE``). Needs temperature > 0."""
  return truncated_logits(logits_v, temperature=settings.temperature, top_k=settings.top_k,
                          top_p=settings.top_p)


def truncated_logits(logits_v: jax.Array, *, temperature: float, top_k: int = 0,
                     top_p: float = 1.0) -> jax.Array:
  """``logits / temperature`` ``[..., V]`` with the tokens outside the top-k set, then outside the
  top-p (nucleus) set of what remains, at ``OUTSIDE``. Top-p keeps the smallest prefix of the
  descending order whose probability reaches ``top_p`` (the first token always)."""
  logits = logits_v.astype(jnp.float32) / temperature
  if top_k:
    k = min(top_k, logits.shape[-1])
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    logits = jnp.where(logits < kth, OUTSIDE, logits)
  if top_p < 1.0:
    sorted_desc = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = mass_before < top_p
    threshold = jnp.min(jnp.where(kept, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, OUTSIDE, logits)
  return logits


def sample(logits_bv: jax.Array, key: jax.Array, settings: SamplingSettings):
  """Samples one token per row with ``key`` (one key for the batch, or typed keys [B], one per row).
  Returns (tokens [B] int32, logp [B] float32)."""
  raw_logp = jax.nn.log_softmax(logits_bv.astype(jnp.float32), axis=-1)
  if settings.temperature == 0:
    tokens = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    return tokens, jnp.take_along_axis(raw_logp, tokens[:, None], axis=-1)[:, 0]
  logits = sampling_logits(logits_bv, settings)
  if key.ndim == 1 and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):  # a key per row
    tokens = jax.vmap(lambda k, row: jax.random.categorical(k, row))(key, logits).astype(jnp.int32)
  else:
    tokens = jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
  source = jax.nn.log_softmax(logits, axis=-1) if settings.logprob_source == "sampling" else raw_logp
  return tokens, jnp.take_along_axis(source, tokens[:, None], axis=-1)[:, 0]

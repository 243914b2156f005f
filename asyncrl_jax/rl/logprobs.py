"""Per-token log-probabilities of given tokens under given params (the prox pass, evaluation, the loss).

Alignment: ``logp[b, t] = log p(tokens[b, t] | tokens[b, :t] of the same segment)``; it is computed from
the logits at ``t - 1``. The first token of each segment (and padding, segment 0) has no context and
gets 0: such positions must carry mask 0.

``temperature``, ``top_k`` and ``top_p`` give the distribution the log-probs are in: the one the
behaviour log-probs were recorded in (``models.sampling.SamplingSettings.recorded``), so that the prox
pass and the loss compare like with like. A token outside the top-k / top-p set of the given weights
gets log-prob ``sampling.OUTSIDE`` (finite: no NaN anywhere), which the loss masks out. Where
``eos_banned_bt`` is set, the ``eos_ban_ids`` (the stop tokens) are banned first, as the decode server
banned them inside a request's minimum length (``sampling.ban_stop_tokens``).

``vocab_chunk > 0`` computes the log-softmax a vocabulary chunk at a time (an online log-sum-exp, each
chunk recomputed in the backward pass), so neither pass holds ``[B, T, V]`` logits: at Qwen's 151936
vocabulary and an 8k-token micro-batch those are 5 GB in float32, each. ``remat`` recomputes each
transformer block in the backward pass instead of keeping its activations.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from asyncrl_jax.models import api
from asyncrl_jax.models.api import aligned  # (shared with the value head: one shift)
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.models.forward import Forward
from asyncrl_jax.models.sampling import ban_stop_tokens, truncated_logits


def logprobs_from_logits(logits_btv, tokens_bt, segment_ids_bt, *, temperature: float = 1.0,
                         top_k: int = 0, top_p: float = 1.0, with_entropy: bool = False,
                         eos_banned_bt=None, eos_ban_ids: tuple = ()):
  """Aligned per-token log-probs ``[B, T]`` (and entropies ``[B, T]`` of the predicting distribution)."""
  logits = logits_btv[:, :-1]
  if eos_ban_ids:  # token t is predicted at t - 1, so its flag bans the stop tokens there
    logits = ban_stop_tokens(logits, eos_banned_bt[:, 1:], eos_ban_ids)
  logits = truncated_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
  targets = tokens_bt[:, 1:]
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  entropy = None
  if with_entropy:
    entropy = lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
  return aligned(picked - lse, entropy, segment_ids_bt, with_entropy)


_MASKED = -1e30  # the padded columns of the last vocabulary chunk: finite, so 0 * logit is 0, not NaN


def _chunked_head(head_dv, chunk: int):
  """``[n, D, chunk]`` slices of the output projection, zero-padded to a whole number of chunks."""
  d, v = head_dv.shape
  n = -(-v // chunk)
  if n * chunk != v:
    head_dv = jnp.pad(head_dv, ((0, 0), (0, n * chunk - v)))
  return head_dv.reshape(d, n, chunk).transpose(1, 0, 2)


def chunked_logsoftmax(hidden_btd, head_dv, targets_bt, *, chunk: int, temperature: float = 1.0,
                       banned_bt=None, ban_ids: tuple = ()):
  """``(log p(targets), entropy)``, each ``[B, T]``, of ``softmax(hidden @ head / temperature)``,
  one vocabulary chunk of ``chunk`` columns at a time (with the ``ban_ids`` columns left out where
  ``banned_bt`` is set).

  Equal to the full log-softmax up to float rounding. The scan keeps a running max, sum of exps, sum
  of exp-weighted logits (for the entropy) and the target's logit; each step is rematerialised, so the
  backward pass holds one ``[B, T, chunk]`` block at a time.
  """
  v = head_dv.shape[1]
  heads = _chunked_head(head_dv, chunk)

  @jax.checkpoint
  def step(carry, xs):
    m, s, sl, picked = carry
    head_dc, start = xs
    logits = jnp.einsum("BTD,DC->BTC", hidden_btd, head_dc.astype(hidden_btd.dtype))
    logits = logits.astype(jnp.float32) / temperature
    cols = start + jnp.arange(chunk)
    logits = jnp.where(cols < v, logits, _MASKED)
    if ban_ids:
      is_banned = jnp.isin(cols, jnp.asarray(ban_ids, jnp.int32)) & (banned_bt[..., None] > 0)
      logits = jnp.where(is_banned, _MASKED, logits)
    m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(logits, axis=-1)))  # any m is exact
    scale = jnp.exp(m - m_new)
    e = jnp.exp(logits - m_new[..., None])
    s = s * scale + jnp.sum(e, axis=-1)
    sl = sl * scale + jnp.sum(jnp.where(cols < v, e * logits, 0.0), axis=-1)
    picked = picked + jnp.sum(jnp.where(cols == targets_bt[..., None], logits, 0.0), axis=-1)
    return (m_new, s, sl, picked), None

  zeros = jnp.zeros(targets_bt.shape, jnp.float32)
  starts = jnp.arange(heads.shape[0], dtype=jnp.int32) * chunk
  (m, s, sl, picked), _ = jax.lax.scan(step, (zeros + _MASKED, zeros, zeros, zeros), (heads, starts))
  lse = m + jnp.log(s)
  return picked - lse, lse - sl / s


def token_logprobs(config: ModelConfig, params, tokens_bt, positions_bt, segment_ids_bt, *,
                   temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   mesh: Optional[Mesh] = None, with_entropy: bool = False,
                   forward: Forward = Forward(), vocab_chunk: int = 0, eos_banned_bt=None,
                   eos_ban_ids: tuple = (), routes_btlk=None, with_moe: bool = False):
  """Traceable: forward + aligned log-probs (use inside a jitted loss).

  A mixture-of-experts model: ``routes_btlk`` ``[B, T, L_moe, k]`` replays those experts (routing
  replay); ``with_moe`` also returns the pass's ``models.api.MoEOutputs`` (as the last element).

  ``vocab_chunk``: columns per chunk of the log-softmax (0: the whole vocabulary at once, through
  ``[B, T, V]`` logits; needed for top-k / top-p, which look at the whole vocabulary). ``forward``:
  attention kind and chunk, remat policy, layer scan (``models.forward``). ``eos_banned_bt`` ``[B, T]`` and
  ``eos_ban_ids``: the stop tokens banned at the flagged tokens (a minimum length).
  """
  if eos_ban_ids and eos_banned_bt is None:
    raise ValueError("eos_ban_ids given without eos_banned_bt (which tokens were sampled under the ban)")
  moe_kwargs = dict(routes_btlk=routes_btlk, with_moe=with_moe)

  def out(result, moe):
    if not with_moe:
      return result
    return (*result, moe) if isinstance(result, tuple) else (result, moe)

  if not vocab_chunk:
    logits = api.apply_logits(config, params, tokens_bt, positions_bt, segment_ids_bt, mesh,
                              forward=forward, **moe_kwargs)
    logits, moe = logits if with_moe else (logits, None)
    return out(logprobs_from_logits(logits, tokens_bt, segment_ids_bt, temperature=temperature,
                                    top_k=top_k, top_p=top_p, with_entropy=with_entropy,
                                    eos_banned_bt=eos_banned_bt, eos_ban_ids=eos_ban_ids), moe)
  if top_k or top_p < 1.0:
    raise ValueError(f"top_k={top_k}, top_p={top_p} with vocab_chunk={vocab_chunk}: the truncated "
                     "log-softmax needs the whole vocabulary (learner.vocab_chunk=0)")
  hidden = api.apply_hidden(config, params, tokens_bt, positions_bt, segment_ids_bt, mesh,
                            forward=forward, **moe_kwargs)
  (hidden, head), moe = hidden if with_moe else (hidden, None)
  logp, entropy = chunked_logsoftmax(hidden[:, :-1], head, tokens_bt[:, 1:], chunk=vocab_chunk,
                                     temperature=temperature,
                                     banned_bt=None if eos_banned_bt is None else eos_banned_bt[:, 1:],
                                     ban_ids=eos_ban_ids)
  return out(aligned(logp, entropy, segment_ids_bt, with_entropy), moe)


@functools.lru_cache(maxsize=None)
def _jitted(config: ModelConfig, temperature: float, top_k: int, top_p: float, mesh: Optional[Mesh],
            vocab_chunk: int, eos_ban_ids: tuple):
  def run(params, tokens, positions, segments, banned):
    return token_logprobs(config, params, tokens, positions, segments, temperature=temperature,
                          top_k=top_k, top_p=top_p, mesh=mesh, vocab_chunk=vocab_chunk,
                          eos_banned_bt=banned, eos_ban_ids=eos_ban_ids)
  return jax.jit(run)


def compute_logprobs(config: ModelConfig, params, tokens_bt, positions_bt, segment_ids_bt, *,
                     temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                     mesh: Optional[Mesh] = None, vocab_chunk: int = 0, eos_banned_bt=None,
                     eos_ban_ids: tuple = ()) -> jax.Array:
  """One jitted pass: per-token log-probs ``[B, T]`` of ``tokens_bt`` under ``params``.

  Used once per global batch for ``prox_logp`` (with the weights before the update) and for scoring.
  """
  ids = tuple(int(i) for i in eos_ban_ids)
  return _jitted(config, float(temperature), int(top_k), float(top_p), mesh, int(vocab_chunk), ids)(
      params, jnp.asarray(tokens_bt, jnp.int32), jnp.asarray(positions_bt, jnp.int32),
      jnp.asarray(segment_ids_bt, jnp.int32),
      None if eos_banned_bt is None else jnp.asarray(eos_banned_bt, jnp.float32))

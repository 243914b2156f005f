"""Policy objectives under staleness: naive PPO, decoupled PPO (AReaL), DIS (SAO).

All arrays are ``[B, T]`` (any shape works, as long as all agree). ``mask`` is 1 on policy tokens (sampled
actions) and 0 elsewhere (prompt, tool output, padding). ``advantages`` are already per token.

Aggregation: every loss is the (weighted) token mean over the global batch,

    loss = sum_t mask_t * c_t * L_t / normalizer,   normalizer = max(sum_t mask_t, 1)  (default),

where ``c_t`` is the optional per-token ``loss_weight`` (1 by default; sequence-mean aggregation sets
``c_t = (T / N) / n_i`` on the tokens of sequence ``i``, see ``batching.weight_sequences_equally``).
Every ``L_t`` is linear in ``A_t`` for ``c_t > 0``, so weighting the loss is the same as weighting the
advantages, but advantages stay advantages.

and tokens dropped by a cap or by the DIS interval stay in the normalizer, so dropping never inflates
the remaining tokens' gradient. Pass ``normalizer`` explicitly when one global batch is split into
micro-batches whose gradients are summed.

Numerics: log-ratios are formed from the given log-probs and exponentiated after clamping to
``MAX_LOG_RATIO`` (e^20 ~ 4.9e8), so no ratio overflows float32; masked-out positions are replaced by
0 *before* any exp (the "double where"), so garbage in padding never reaches the loss or its gradient.
Ratios beyond e^20 saturate: their value is capped and their gradient is 0.

Every function returns ``(loss, metrics)``; metrics are computed without gradient, scalars:
``clipped_frac``, ``dropped_frac``, ``iw_mean``, ``iw_max`` (importance weight over policy tokens),
``kl_behav`` / ``kl_prox`` (k3 estimate of KL(pi_ref || pi_theta) from the ref's samples:
E[(r - 1) - log r], r = pi_theta / pi_ref), and ``entropy`` when per-token entropies are given; and
one per-token array, ``dropped`` (``[B, T]``, 1 on the policy tokens counted by ``dropped_frac``),
which ``rl.selection`` breaks down by completion length and staleness.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

MAX_LOG_RATIO = 20.0

Metrics = dict[str, jax.Array]


def _masked(mask, x):
  return jnp.where(mask > 0, x, 0.0)


def _safe_log_ratio(mask, num, den):
  """``num - den`` on policy tokens, 0 elsewhere, clamped above; NaN-free for any padding content."""
  diff = _masked(mask, num) - _masked(mask, den)
  return jnp.minimum(diff, MAX_LOG_RATIO)


def _normalizer(mask, normalizer):
  if normalizer is None:
    return jnp.maximum(jnp.sum(mask), 1.0)
  return jnp.maximum(jnp.asarray(normalizer, jnp.float32), 1.0)


def _weighted_sum(mask, loss_weight, per_token):
  """``sum_t mask_t * c_t * L_t`` (``c = loss_weight``, 1 when None), NaN-free for padding content."""
  if loss_weight is not None:
    per_token = _masked(mask, loss_weight) * per_token
  return jnp.sum(_masked(mask, per_token))


def _mean(mask, x):
  return jnp.sum(_masked(mask, x)) / jnp.maximum(jnp.sum(mask), 1.0)


def _k3(mask, log_ratio):
  """k3 KL estimator E[(r - 1) - log r] with r = exp(log_ratio), over policy tokens."""
  return _mean(mask, jnp.expm1(log_ratio) - log_ratio)


def _clipped_surrogate(ratio, advantages, eps_clip):
  """PPO's ``-min(r * A, clip(r, 1 - eps, 1 + eps) * A)`` per token, and where the clip is active."""
  unclipped = ratio * advantages
  clipped = jnp.clip(ratio, 1.0 - eps_clip, 1.0 + eps_clip) * advantages
  return -jnp.minimum(unclipped, clipped), clipped < unclipped


def _common_metrics(mask, weight, log_ratio_behav, entropy) -> Metrics:
  sg = jax.lax.stop_gradient
  metrics = {
      "iw_mean": _mean(mask, sg(weight)),
      "iw_max": jnp.max(jnp.where(mask > 0, sg(weight), 0.0)),
      "kl_behav": _k3(mask, sg(log_ratio_behav)),
      "policy_tokens": jnp.sum(mask),
  }
  if entropy is not None:
    metrics["entropy"] = _mean(mask, sg(entropy))
  return metrics


def naive_ppo_loss(logp, old_logp, advantages, mask, *, eps_clip: float = 0.2,
                   normalizer=None, entropy=None, loss_weight=None) -> tuple[jax.Array, Metrics]:
  """PPO with a single ``pi_old`` (here the behaviour policy): the baseline that breaks under staleness.

  ``r = exp(logp - old_logp)``, ``L_t = -min(r * A, clip(r, 1 - eps, 1 + eps) * A)``.

  Args:
    logp: [B, T] log pi_theta(a_t | s_t), differentiable.
    old_logp: [B, T] log-probs of the policy taken as pi_old (no gradient).
    advantages: [B, T] per-token advantages.
    mask: [B, T] 1 on policy tokens.
    eps_clip: clip range.
    normalizer: optional denominator (see module docstring).
    entropy: optional [B, T] per-token entropy, for metrics only.
    loss_weight: optional [B, T] per-token weight ``c_t >= 0`` of the loss (see module docstring).
  """
  mask = mask.astype(jnp.float32)
  log_ratio = _safe_log_ratio(mask, logp, jax.lax.stop_gradient(old_logp))
  ratio = jnp.exp(log_ratio)
  per_token, clipped = _clipped_surrogate(ratio, advantages, eps_clip)
  loss = _weighted_sum(mask, loss_weight, per_token) / _normalizer(mask, normalizer)
  metrics = _common_metrics(mask, ratio, log_ratio, entropy)
  metrics.update(clipped_frac=_mean(mask, clipped.astype(jnp.float32)),
                 dropped_frac=jnp.zeros((), jnp.float32), dropped=jnp.zeros_like(mask))
  return loss, metrics


def decoupled_ppo_loss(logp, prox_logp, behav_logp, advantages, mask, *, eps_clip: float = 0.2,
                       behav_weight_cap: Optional[float] = None,
                       behav_weight_floor: Optional[float] = None,
                       behav_weight_clip: Optional[float] = None, normalizer=None,
                       entropy=None, loss_weight=None) -> tuple[jax.Array, Metrics]:
  """AReaL's decoupled PPO: importance-correct to the behaviour policy, trust region around prox.

  ``w = exp(prox_logp - behav_logp)`` (no gradient), ``u = exp(logp - prox_logp)``,
  ``L_t = -w * min(u * A, clip(u, 1 - eps, 1 + eps) * A)``. Tokens with ``w > behav_weight_cap`` or
  ``w < behav_weight_floor`` get weight 0 (they stay in the normalizer); ``None`` (or an infinite cap,
  a floor of 0) drops nothing. ``behav_weight_clip`` truncates instead of dropping: the weight of a
  kept token is ``min(w, clip)`` (V-trace's truncated importance weight). With
  ``prox_logp == behav_logp`` this is exactly ``naive_ppo_loss`` (w = 1).

  Under staleness ``w`` is heavy-tailed (up to 10-1000 at eta 8 in the built-in probe). Unbounded, a
  few tokens steer the update; dropped above a cap (AReaL's guard), the stale tokens that the policy
  has come to prefer although they scored badly, which carry most of the corrective signal, are lost.
  The shipped configs truncate instead (``behav_weight_clip=1``): no stale token weighs more than a
  fresh one (NOTES.md, "Decoupled PPO under staleness").

  Args:
    logp: [B, T] log pi_theta, differentiable.
    prox_logp: [B, T] log-probs under the weights before this update (recomputed once per batch).
    behav_logp: [B, T] log-probs recorded when each token was sampled.
    advantages, mask, eps_clip, normalizer, entropy, loss_weight: as in ``naive_ppo_loss``.
    behav_weight_cap: optional cap on ``w`` (tokens above it are dropped).
    behav_weight_floor: optional floor on ``w`` (tokens below it are dropped).
    behav_weight_clip: optional truncation of ``w`` (kept tokens weigh ``min(w, clip)``).
  """
  mask = mask.astype(jnp.float32)
  prox_logp = jax.lax.stop_gradient(prox_logp)
  behav_logp = jax.lax.stop_gradient(behav_logp)
  log_w = _safe_log_ratio(mask, prox_logp, behav_logp)
  weight = jnp.exp(log_w)
  dropped = jnp.zeros_like(mask, dtype=bool)
  if behav_weight_cap is not None:
    dropped |= weight > behav_weight_cap
  if behav_weight_floor is not None:
    dropped |= weight < behav_weight_floor
  dropped &= mask > 0
  weight = jnp.where(dropped, 0.0, weight)
  if behav_weight_clip is not None:
    weight = jnp.minimum(weight, behav_weight_clip)
  log_u = _safe_log_ratio(mask, logp, prox_logp)
  per_token, clipped = _clipped_surrogate(jnp.exp(log_u), advantages, eps_clip)
  loss = _weighted_sum(mask, loss_weight, weight * per_token) / _normalizer(mask, normalizer)
  log_ratio_behav = _safe_log_ratio(mask, logp, behav_logp)
  metrics = _common_metrics(mask, weight, log_ratio_behav, entropy)
  metrics.update(clipped_frac=_mean(mask, (clipped & ~dropped).astype(jnp.float32)),
                 dropped_frac=_mean(mask, dropped.astype(jnp.float32)),
                 dropped=dropped.astype(jnp.float32), kl_prox=_k3(mask, jax.lax.stop_gradient(log_u)))
  return loss, metrics


def dis_loss(logp, behav_logp, advantages, mask, *, eps_low: float, eps_high: float,
             normalizer=None, entropy=None, loss_weight=None) -> tuple[jax.Array, Metrics]:
  """SAO's DIS: keep a token's importance weight only strictly inside ``(1 - eps_low, 1 + eps_high)``.

  ``rho = exp(logp - behav_logp)``, ``keep = (1 - eps_low < rho < 1 + eps_high)`` (decided without
  gradient), ``L_t = -keep * rho * A``. Tokens outside the interval, boundaries included, contribute
  exactly 0 to the loss and its gradient, and stay in the normalizer. No prox pass is needed.

  Args:
    logp: [B, T] log pi_theta, differentiable.
    behav_logp: [B, T] log-probs recorded when each token was sampled.
    advantages, mask, normalizer, entropy, loss_weight: as in ``naive_ppo_loss``.
    eps_low: 0 < eps_low < 1.
    eps_high: > 0.
  """
  mask = mask.astype(jnp.float32)
  behav_logp = jax.lax.stop_gradient(behav_logp)
  log_rho = _safe_log_ratio(mask, logp, behav_logp)
  rho_sg = jnp.exp(jax.lax.stop_gradient(log_rho))
  keep = (rho_sg > 1.0 - eps_low) & (rho_sg < 1.0 + eps_high) & (mask > 0)
  rho = jnp.exp(jnp.where(keep, log_rho, 0.0))  # no exp of dropped tokens' values in the gradient path
  per_token = jnp.where(keep, -rho * advantages, 0.0)
  loss = _weighted_sum(mask, loss_weight, per_token) / _normalizer(mask, normalizer)
  metrics = _common_metrics(mask, rho_sg, log_rho, entropy)
  dropped = ((~keep) & (mask > 0)).astype(jnp.float32)
  metrics.update(clipped_frac=jnp.zeros((), jnp.float32), dropped_frac=_mean(mask, dropped),
                 dropped=dropped)
  return loss, metrics


LossFn = Callable[..., tuple[jax.Array, Metrics]]


def policy_loss(name: str, *, logp, behav_logp, prox_logp, advantages, mask, eps_clip: float,
                eps_low: float, eps_high: float, behav_weight_cap: Optional[float] = None,
                behav_weight_floor: Optional[float] = None,
                behav_weight_clip: Optional[float] = None, normalizer=None,
                entropy=None, loss_weight=None) -> tuple[jax.Array, Metrics]:
  """Dispatches on ``rl.loss`` (a Python string, so no traced branching).

  ``ppo`` uses ``behav_logp`` as pi_old; ``decoupled_ppo`` needs ``prox_logp``; ``dis`` ignores it.
  """
  if name == "ppo":
    return naive_ppo_loss(logp, behav_logp, advantages, mask, eps_clip=eps_clip,
                          normalizer=normalizer, entropy=entropy, loss_weight=loss_weight)
  if name == "decoupled_ppo":
    if prox_logp is None:
      raise ValueError("decoupled_ppo needs prox_logp (the prox log-prob pass)")
    return decoupled_ppo_loss(logp, prox_logp, behav_logp, advantages, mask, eps_clip=eps_clip,
                              behav_weight_cap=behav_weight_cap,
                              behav_weight_floor=behav_weight_floor,
                              behav_weight_clip=behav_weight_clip, normalizer=normalizer,
                              entropy=entropy, loss_weight=loss_weight)
  if name == "dis":
    return dis_loss(logp, behav_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high,
                    normalizer=normalizer, entropy=entropy, loss_weight=loss_weight)
  raise ValueError(f"rl.loss={name!r}: must be one of ('ppo', 'decoupled_ppo', 'dis')")


def needs_prox(name: str) -> bool:
  """Whether the loss needs the prox log-prob pass (only decoupled PPO)."""
  return name == "decoupled_ppo"

"""Policy objectives under staleness, and the off-policy corrections that compose with them.

Objectives (``rl.loss``): PPO on the behaviour ratio (``ppo``), standard PPO with the old log-probs
recomputed before the update (``ppo_recompute``: the seeds' naive baseline, which ignores the
behaviour policy), decoupled PPO (AReaL), DIS (SAO; optionally sign-aware), GSPO (Qwen; a
sequence-level ratio and clip, corrected for staleness as decoupled PPO is). Corrections
(``Corrections``, all off by default): truncated importance sampling (TIS), IcePop's two-sided token
mask, a sequence-level geometric-mean mask, and PPO's dual clip.

All arrays are ``[B, T]`` (any shape works, as long as all agree). ``mask`` is 1 on policy tokens (sampled
actions) and 0 elsewhere (prompt, tool output, padding). ``advantages`` are already per token.

Aggregation: every loss is the (weighted) token mean over the global batch,

    loss = sum_t mask_t * c_t * L_t / normalizer,   normalizer = max(sum_t mask_t, 1)  (default),

where ``c_t`` is the optional per-token ``loss_weight`` (1 by default; sequence-mean aggregation sets
``c_t = (T / N) / n_i`` on the tokens of sequence ``i``, see ``batching.weight_sequences_equally``).
Every ``L_t`` is linear in ``A_t`` for ``c_t > 0``, so weighting the loss is the same as weighting the
advantages, but advantages stay advantages (GSPO's ``L_t`` reads its sequence's mean advantage: there
the equivalence holds for weights constant along each sequence, as sequence-mean's are).

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
E[(r - 1) - log r], r = pi_theta / pi_ref), ``kl_behav_prox`` where a proximal pass ran (KL(behaviour ||
proximal): staleness plus any serving mismatch, and at staleness 0 the mismatch alone, e.g. int8
rollout, which ``kl_behav`` mixes with the update's own step), and ``entropy`` when per-token
entropies are given; and
two per-token arrays, ``dropped`` and ``clipped`` (``[B, T]``, 1 on the policy tokens counted by
``dropped_frac`` / ``clipped_frac``), which ``rl.selection`` breaks down by completion length,
staleness, the side of the behaviour ratio and the sign of the advantage.
"""

from __future__ import annotations

import dataclasses
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


def _per_sequence(x, mask, segment_ids):
  """Per token, the mean of ``x`` over the policy tokens of its sequence, and how many there are:
  ``[B, T] -> ([B, T], [B, T])``, both 0 where ``mask`` is 0. Packed rows hold several sequences
  (``segment_ids``, 0 = padding); a row's sequences are its own. Differentiable in ``x``; padding
  content never reaches the mean or its gradient."""
  mask = jnp.asarray(mask, jnp.float32)
  x = _masked(mask, x)
  segment_ids = jnp.asarray(segment_ids)
  width = segment_ids.shape[1]

  def row(x_t, m_t, seg_t):
    total = jax.ops.segment_sum(x_t, seg_t, num_segments=width + 1)
    count = jax.ops.segment_sum(m_t, seg_t, num_segments=width + 1)
    return (total / jnp.maximum(count, 1.0))[seg_t], count[seg_t]

  mean, count = jax.vmap(row)(x, mask, segment_ids)
  return _masked(mask, mean), _masked(mask, count)


def _behaviour_weight(log_w, mask, cap, floor, clip):
  """``exp(log_w)`` with decoupled PPO's guards: 0 above ``cap`` or below ``floor`` (the dropped
  policy tokens, returned as a bool), then truncated to ``min(w, clip)``; ``None`` turns a guard off."""
  weight = jnp.exp(log_w)
  dropped = jnp.zeros_like(mask, dtype=bool)
  if cap is not None:
    dropped |= weight > cap
  if floor is not None:
    dropped |= weight < floor
  dropped &= mask > 0
  weight = jnp.where(dropped, 0.0, weight)
  if clip is not None:
    weight = jnp.minimum(weight, clip)
  return weight, dropped


def _clipped_surrogate(ratio, advantages, eps_low, eps_high, dual_clip=None):
  """PPO's ``-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)`` elementwise, and where a clip is
  active (no gradient flows through the element). ``dual_clip`` (``c > 1``): for ``A < 0`` the
  objective is also bounded below by ``c * A``, i.e. the loss is at most ``-c * A``
  (``dual_clip_surrogate``)."""
  unclipped = ratio * advantages
  clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
  objective = jnp.minimum(unclipped, clipped)
  active = clipped < unclipped
  if dual_clip is not None:
    objective, dual = dual_clip_surrogate(objective, advantages, dual_clip)
    active = active | dual
  return -objective, active


def dual_clip_surrogate(objective, advantages, c: float):
  """PPO's dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"; verl's
  ``clip_ratio_c``): for tokens with ``A < 0``, ``max(objective, c * A)``; others unchanged.

  With ``A < 0`` PPO's clip bounds the ratio only from below, so a stale token whose probability has
  since grown a lot (ratio >> 1) pushes with weight ``r * |A|``, unbounded; the dual clip caps that
  push at ``c * |A|``. Returns the new objective and where the bound is active (no gradient there).

  Args:
    objective: [B, T] PPO's per-token objective ``min(r * A, clip(r) * A)`` (to maximise).
    advantages: [B, T].
    c: the bound, > 1 (verl's default 3).
  """
  bound = c * advantages
  active = (advantages < 0) & (objective < bound)
  return jnp.where(active, bound, objective), active


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


def naive_ppo_loss(logp, old_logp, advantages, mask, *, eps_clip: float = 0.2, dual_clip=None,
                   normalizer=None, entropy=None, loss_weight=None) -> tuple[jax.Array, Metrics]:
  """PPO with a single ``pi_old``: the behaviour policy (``rl.loss=ppo``) or the weights before the
  update (``rl.loss=ppo_recompute``, the seeds' naive baseline, which ignores the behaviour policy).

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
    dual_clip: optional bound ``c > 1`` for negative advantages (``dual_clip_surrogate``).
  """
  mask = mask.astype(jnp.float32)
  log_ratio = _safe_log_ratio(mask, logp, jax.lax.stop_gradient(old_logp))
  ratio = jnp.exp(log_ratio)
  per_token, clipped = _clipped_surrogate(ratio, advantages, eps_clip, eps_clip, dual_clip)
  loss = _weighted_sum(mask, loss_weight, per_token) / _normalizer(mask, normalizer)
  metrics = _common_metrics(mask, ratio, log_ratio, entropy)
  clipped = (clipped & (mask > 0)).astype(jnp.float32)
  metrics.update(clipped_frac=_mean(mask, clipped), clipped=clipped,
                 dropped_frac=jnp.zeros((), jnp.float32), dropped=jnp.zeros_like(mask))
  return loss, metrics


def decoupled_ppo_loss(logp, prox_logp, behav_logp, advantages, mask, *, eps_clip: float = 0.2,
                       behav_weight_cap: Optional[float] = None,
                       behav_weight_floor: Optional[float] = None,
                       behav_weight_clip: Optional[float] = None, dual_clip=None, normalizer=None,
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
  fresh one (docs/decisions/0004-decoupled-ppo-with-truncated-behaviour-weight.md).

  Args:
    logp: [B, T] log pi_theta, differentiable.
    prox_logp: [B, T] log-probs under the weights before this update (recomputed once per batch).
    behav_logp: [B, T] log-probs recorded when each token was sampled.
    advantages, mask, eps_clip, normalizer, entropy, loss_weight: as in ``naive_ppo_loss``.
    behav_weight_cap: optional cap on ``w`` (tokens above it are dropped).
    behav_weight_floor: optional floor on ``w`` (tokens below it are dropped).
    behav_weight_clip: optional truncation of ``w`` (kept tokens weigh ``min(w, clip)``).
    dual_clip: optional dual-clip bound on ``u`` for negative advantages (``dual_clip_surrogate``).
  """
  mask = mask.astype(jnp.float32)
  prox_logp = jax.lax.stop_gradient(prox_logp)
  behav_logp = jax.lax.stop_gradient(behav_logp)
  log_w = _safe_log_ratio(mask, prox_logp, behav_logp)
  weight, dropped = _behaviour_weight(log_w, mask, behav_weight_cap, behav_weight_floor,
                                      behav_weight_clip)
  log_u = _safe_log_ratio(mask, logp, prox_logp)
  per_token, clipped = _clipped_surrogate(jnp.exp(log_u), advantages, eps_clip, eps_clip, dual_clip)
  loss = _weighted_sum(mask, loss_weight, weight * per_token) / _normalizer(mask, normalizer)
  log_ratio_behav = _safe_log_ratio(mask, logp, behav_logp)
  metrics = _common_metrics(mask, weight, log_ratio_behav, entropy)
  clipped = (clipped & ~dropped & (mask > 0)).astype(jnp.float32)
  metrics.update(clipped_frac=_mean(mask, clipped), clipped=clipped,
                 dropped_frac=_mean(mask, dropped.astype(jnp.float32)),
                 dropped=dropped.astype(jnp.float32), kl_prox=_k3(mask, jax.lax.stop_gradient(log_u)),
                 kl_behav_prox=_k3(mask, log_w))
  return loss, metrics


def dis_loss(logp, behav_logp, advantages, mask, *, eps_low: float, eps_high: float,
             sign_aware: bool = False, normalizer=None, entropy=None,
             loss_weight=None) -> tuple[jax.Array, Metrics]:
  """SAO's DIS: keep a token's importance weight only strictly inside ``(1 - eps_low, 1 + eps_high)``.

  ``rho = exp(logp - behav_logp)``, ``keep = (1 - eps_low < rho < 1 + eps_high)`` (decided without
  gradient), ``L_t = -keep * rho * A``. Tokens outside the interval, boundaries included, contribute
  exactly 0 to the loss and its gradient, and stay in the normalizer. No prox pass is needed.

  ``sign_aware=True`` masks only the tokens whose drift *agrees* with their advantage: ``rho`` at or
  above ``1 + eps_high`` with ``A > 0`` (already pushed up) and ``rho`` at or below ``1 - eps_low``
  with ``A < 0`` (already pushed down). A token that drifted against its advantage (a stale mistake
  the policy has come to prefer, ``rho`` high and ``A < 0``) keeps its weight ``rho``: the restoring
  gradient that the plain mask drops and PPO keeps (the mechanism behind DIS's collapse under
  staleness in the built-in task's grid; PPO's ``min`` keeps exactly these tokens too).

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
  if sign_aware:
    agrees = ((rho_sg >= 1.0 + eps_high) & (advantages > 0)) | ((rho_sg <= 1.0 - eps_low) & (advantages < 0))
    keep = ~agrees & (mask > 0)
  else:
    keep = (rho_sg > 1.0 - eps_low) & (rho_sg < 1.0 + eps_high) & (mask > 0)
  rho = jnp.exp(jnp.where(keep, log_rho, 0.0))  # no exp of dropped tokens' values in the gradient path
  per_token = jnp.where(keep, -rho * advantages, 0.0)
  loss = _weighted_sum(mask, loss_weight, per_token) / _normalizer(mask, normalizer)
  metrics = _common_metrics(mask, rho_sg, log_rho, entropy)
  dropped = ((~keep) & (mask > 0)).astype(jnp.float32)
  metrics.update(clipped_frac=jnp.zeros((), jnp.float32), clipped=jnp.zeros_like(mask),
                 dropped_frac=_mean(mask, dropped), dropped=dropped)
  return loss, metrics


def gspo_loss(logp, prox_logp, behav_logp, advantages, mask, *, eps_low: float = 3e-4,
              eps_high: float = 4e-4, segment_ids=None, behav_weight_cap: Optional[float] = None,
              behav_weight_floor: Optional[float] = None,
              behav_weight_clip: Optional[float] = None, dual_clip=None, normalizer=None,
              entropy=None, loss_weight=None) -> tuple[jax.Array, Metrics]:
  """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", the Qwen team's objective for
  stable mixture-of-experts RL): one length-normalised ratio and one clip per sequence, with
  decoupled PPO's staleness correction lifted to the sequence.

  For sequence ``i`` with policy tokens ``t`` (``mask``), ``n_i = |y_i|`` of them::

      s_i = exp((1 / n_i) sum_t (logp_t - prox_logp_t))     geometric mean of pi_theta / pi_prox
      w_i = exp((1 / n_i) sum_t (prox_logp_t - behav_logp_t))   no gradient; decoupled PPO's guards
      A_i = (1 / n_i) sum_t A_t                               the sequence's advantage
      L_i = -w_i * min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)

  Staleness: the tokens were sampled by ``pi_behav``, up to eta versions old. As in decoupled PPO
  (AReaL) the trust region is around ``pi_prox`` (the weights before this update, recomputed by the
  learner: GSPO's ``pi_old``) and the sequence is importance-weighted back to ``pi_behav`` by its
  geometric-mean weight ``w_i`` (length-normalised like ``s_i``: the exact sequence weight, the
  product of the token weights, explodes or vanishes with length), which ``behav_weight_cap`` /
  ``floor`` drop (the whole sequence) and ``behav_weight_clip`` truncates, as decoupled PPO treats
  its token weight. With ``prox_logp == behav_logp`` (eta 0) ``w_i = 1`` and this is plain GSPO.

  ``A_i`` is the mean of the per-token advantages over the sequence's policy tokens: group (GRPO)
  advantages are constant along a completion, so this is that constant; per-token (value / GAE)
  advantages are averaged. The paper's gradient is the sequence form's gradient,
  ``grad s_i = s_i * mean_t grad logp_t``, which differentiating ``s_i`` gives (its "GSPO-token"
  variant with a stop-gradient is the same gradient when every token shares ``A_i``).

  Aggregation: ``L_i`` is given to each of the sequence's policy tokens and aggregated as every
  loss here is (module docstring), ``sum_t mask_t c_t L_{i(t)} / N``, so micro-batches sum to the
  global loss. With ``rl.aggregation='sequence_mean'`` (``c_t = (T / S) / n_i`` over ``S``
  sequences) that is the paper's ``-(1 / S) sum_i min(...)`` exactly; with ``token_mean``
  (``c = 1``) each sequence weighs by its length ``n_i``.

  Metrics as ``decoupled_ppo_loss`` (``clipped`` / ``dropped``: the policy tokens of clipped /
  dropped sequences; ``iw_mean``: token mean of ``w_i``), and per sequence: ``seq_ratio_mean``
  (mean ``s_i``), ``seq_clipped_frac``, ``seq_dropped_frac``, ``seq_iw_mean`` (mean ``w_i``).

  Args:
    logp: [B, T] log pi_theta, differentiable.
    prox_logp: [B, T] log-probs under the weights before this update (GSPO's pi_old).
    behav_logp: [B, T] log-probs recorded when each token was sampled.
    advantages, mask, normalizer, entropy, loss_weight: as in ``naive_ppo_loss``.
    eps_low, eps_high: the sequence ratio's clip ``(1 - eps_low, 1 + eps_high)``; the paper's 3e-4
      and 4e-4 (a sequence ratio is a geometric mean: it moves far less than a token's).
    segment_ids: [B, T] int, which sequence of its row each token belongs to (0 = padding), for
      packed rows; None: each row is one sequence.
    behav_weight_cap, behav_weight_floor, behav_weight_clip: the guards on ``w_i`` (as in
      ``decoupled_ppo_loss``, per sequence).
    dual_clip: optional dual-clip bound ``c > 1`` on ``s_i`` for negative ``A_i``.
  """
  sg = jax.lax.stop_gradient
  mask = mask.astype(jnp.float32)
  segment_ids = jnp.ones(mask.shape, jnp.int32) if segment_ids is None else segment_ids
  prox_logp, behav_logp = sg(prox_logp), sg(behav_logp)
  log_u = _safe_log_ratio(mask, logp, prox_logp)
  log_s, count = _per_sequence(log_u, mask, segment_ids)  # a mean of values <= MAX_LOG_RATIO
  ratio = jnp.exp(log_s)
  adv_seq, _ = _per_sequence(sg(advantages), mask, segment_ids)
  log_w_token = _safe_log_ratio(mask, prox_logp, behav_logp)
  log_w, _ = _per_sequence(log_w_token, mask, segment_ids)
  weight, dropped = _behaviour_weight(log_w, mask, behav_weight_cap, behav_weight_floor,
                                      behav_weight_clip)
  per_token, clipped = _clipped_surrogate(ratio, adv_seq, eps_low, eps_high, dual_clip)
  loss = _weighted_sum(mask, loss_weight, weight * per_token) / _normalizer(mask, normalizer)
  metrics = _common_metrics(mask, weight, _safe_log_ratio(mask, logp, behav_logp), entropy)
  clipped = (clipped & ~dropped & (mask > 0)).astype(jnp.float32)
  dropped = dropped.astype(jnp.float32)
  # each sequence's policy tokens share weight 1, so these sums are over sequences
  per_seq = _masked(mask, 1.0 / jnp.maximum(count, 1.0))
  sequences = jnp.maximum(jnp.sum(per_seq), 1.0)
  seq_mean = lambda x: jnp.sum(per_seq * sg(x)) / sequences
  metrics.update(clipped_frac=_mean(mask, clipped), clipped=clipped,
                 dropped_frac=_mean(mask, dropped), dropped=dropped,
                 kl_prox=_k3(mask, sg(log_u)), kl_behav_prox=_k3(mask, log_w_token),
                 seq_ratio_mean=seq_mean(ratio), seq_clipped_frac=seq_mean(clipped),
                 seq_dropped_frac=seq_mean(dropped), seq_iw_mean=seq_mean(weight))
  return loss, metrics


# ---------------------------------------------------------------------------------- corrections


@dataclasses.dataclass(frozen=True)
class Corrections:
  """Off-policy corrections that compose with any objective (config ``rl.correction``; all off by
  default). Each reads the importance ratio ``ratio``: ``"current"`` is ``pi_theta / pi_behav`` (the
  drift since sampling, under the weights being trained), ``"prox"`` is ``pi_prox / pi_behav`` (under
  the weights before the update: needs the prox pass, which ``ppo_recompute``, ``decoupled_ppo``
  and ``gspo`` run, and the others then run for it). Both are constants here (no gradient flows
  through a correction).

  * ``tis_cap``: truncated importance sampling, every token's loss times ``min(ratio, cap)``; only
    with ``ppo_recompute`` (the others have the importance ratio in their objective already:
    truncating decoupled PPO's ``w`` is ``behav_weight_clip``).
  * ``icepop``: ``(low, high)``, a token whose ratio is outside ``[low, high]`` gets weight 0.
  * ``seq_mask``: ``(low, high)``, a whole sequence gets weight 0 when the geometric mean of its
    tokens' ratios is outside ``[low, high]``.
  * ``dual_clip``: ``c > 1``, PPO's dual clip (PPO-family objectives only; GSPO's on its sequence
    ratio).

  Tokens given weight 0 stay in the normaliser, as every dropped token here does.
  """
  ratio: str = "current"
  tis_cap: Optional[float] = None
  icepop: Optional[tuple] = None
  seq_mask: Optional[tuple] = None
  dual_clip: Optional[float] = None

  @property
  def reads_ratio(self) -> bool:
    return self.tis_cap is not None or self.icepop is not None or self.seq_mask is not None

  @property
  def needs_prox(self) -> bool:
    return self.reads_ratio and self.ratio == "prox"


def truncated_is_weight(log_ratio, mask, cap: float):
  """Truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
  You Off-Policy RL Training", as verl, slime and SkyRL ship it): ``min(exp(log_ratio), cap)`` on
  policy tokens, 0 elsewhere, no gradient. Unlike a mask, no token is lost; unlike an unbounded weight,
  none weighs more than ``cap``.

  Args:
    log_ratio: [B, T] log of the importance ratio (e.g. ``log pi_prox - log pi_behav``).
    mask: [B, T] 1 on policy tokens.
    cap: C > 0.
  """
  mask = jnp.asarray(mask, jnp.float32)
  log_ratio = jnp.minimum(_masked(mask, jax.lax.stop_gradient(log_ratio)), MAX_LOG_RATIO)
  return _masked(mask, jnp.minimum(jnp.exp(log_ratio), cap))


def icepop_keep(log_ratio, mask, low: float, high: float):
  """IcePop's two-sided token mask (the Ling team's Ring-1T report, 2025; "masked importance
  sampling" in slime and verl): keep a policy token only while ``low <= ratio <= high``. Returns a
  [B, T] bool, False on padding.

  Args:
    log_ratio: [B, T] log of the importance ratio.
    mask: [B, T] 1 on policy tokens.
    low, high: ``0 <= low < 1 < high``.
  """
  log_ratio = jax.lax.stop_gradient(log_ratio)
  r = jnp.exp(jnp.minimum(_masked(mask, log_ratio), MAX_LOG_RATIO))
  return (r >= low) & (r <= high) & (jnp.asarray(mask) > 0)


def sequence_log_ratio(log_ratio, mask, segment_ids):
  """Per token, the mean of ``log_ratio`` over the policy tokens of its sequence: the log of the
  sequence's geometric-mean ratio (GSPO's length-normalised sequence ratio). Packed rows hold several
  sequences (``segment_ids``, 0 = padding); a row's sequences are its own. [B, T] -> [B, T], 0 where
  ``mask`` is 0. No gradient (``gspo_loss`` takes the differentiable one)."""
  return _per_sequence(jax.lax.stop_gradient(log_ratio), mask, segment_ids)[0]


def sequence_mask_keep(log_ratio, mask, segment_ids, low: float, high: float):
  """The sequence-level geometric-mean mask (verl's sequence-level "geometric" rollout rejection;
  Liu et al. 2025, "When Speed Kills Stability"): every token of a sequence whose geometric-mean
  ratio ``exp(mean_t log_ratio)`` is outside ``[low, high]`` gets weight 0. Length-normalised, so a
  long sequence is not rejected for its length alone. Returns [B, T] bool, False on padding."""
  seq = sequence_log_ratio(log_ratio, mask, segment_ids)
  return (seq >= jnp.log(low)) & (seq <= jnp.log(high)) & (jnp.asarray(mask) > 0)


def correction_weights(corrections: Corrections, *, logp, prox_logp, behav_logp, mask, segment_ids):
  """The per-token weight (``[B, T]``, no gradient) and the tokens zeroed by ``corrections``'s TIS,
  IcePop and sequence mask: ``(weight, zeroed)``; weight 1 and nothing zeroed when none is set."""
  mask = jnp.asarray(mask, jnp.float32)
  weight = jnp.ones_like(mask)
  zeroed = jnp.zeros_like(mask, dtype=bool)
  if not corrections.reads_ratio:
    return weight, zeroed
  if corrections.ratio == "prox":
    if prox_logp is None:
      raise ValueError("rl.correction.ratio='prox' needs the prox log-probs (rl.loss ppo_recompute, "
                       "decoupled_ppo or gspo)")
    num = prox_logp
  else:
    num = logp
  log_ratio = _safe_log_ratio(mask, jax.lax.stop_gradient(num), jax.lax.stop_gradient(behav_logp))
  if corrections.tis_cap is not None:
    weight = truncated_is_weight(log_ratio, mask, corrections.tis_cap)
  if corrections.icepop is not None:
    zeroed |= ~icepop_keep(log_ratio, mask, *corrections.icepop)
  if corrections.seq_mask is not None:
    zeroed |= ~sequence_mask_keep(log_ratio, mask, segment_ids, *corrections.seq_mask)
  zeroed &= mask > 0
  return jnp.where(zeroed, 0.0, weight), zeroed


LOSSES = ("ppo", "ppo_recompute", "decoupled_ppo", "dis", "gspo")
LossFn = Callable[..., tuple[jax.Array, Metrics]]


def policy_loss(name: str, *, logp, behav_logp, prox_logp, advantages, mask, eps_clip: float,
                eps_low: float, eps_high: float, behav_weight_cap: Optional[float] = None,
                behav_weight_floor: Optional[float] = None,
                behav_weight_clip: Optional[float] = None, dis_sign_aware: bool = False,
                gspo_eps_low: float = 3e-4, gspo_eps_high: float = 4e-4,
                corrections: Corrections = Corrections(), segment_ids=None, normalizer=None,
                entropy=None, loss_weight=None) -> tuple[jax.Array, Metrics]:
  """Dispatches on ``rl.loss`` (a Python string, so no traced branching), then ``corrections``.

  ``ppo`` uses ``behav_logp`` as pi_old; ``ppo_recompute`` uses ``prox_logp`` (the weights before the
  update: the behaviour policy is ignored); ``decoupled_ppo`` and ``gspo`` need both; ``dis`` ignores
  ``prox_logp``. ``eps_low`` / ``eps_high`` are DIS's interval, ``gspo_eps_low`` / ``gspo_eps_high``
  GSPO's sequence clip; the ``behav_weight_*`` guards act on decoupled PPO's token weight and on
  GSPO's sequence weight. The corrections' weights multiply each token's loss (as ``loss_weight``
  does; under GSPO, each token's share of its sequence's loss), and the tokens they zero join the
  objective's ``dropped``. ``segment_ids`` ([B, T]) is needed by GSPO (None: one sequence per row)
  and the sequence mask.
  """
  if corrections.dual_clip is not None and name == "dis":
    raise ValueError("rl.correction.dual_clip bounds PPO's clipped objective; rl.loss='dis' has none")
  if corrections.tis_cap is not None and name != "ppo_recompute":
    raise ValueError(f"rl.correction.tis_cap corrects an objective that ignores the behaviour policy "
                     f"(ppo_recompute); rl.loss={name!r} has its importance ratio already (decoupled "
                     "PPO truncates it with rl.behav_weight_clip)")
  mask = jnp.asarray(mask, jnp.float32)
  weight, zeroed = correction_weights(corrections, logp=logp, prox_logp=prox_logp,
                                      behav_logp=behav_logp, mask=mask, segment_ids=segment_ids)
  if corrections.reads_ratio:
    loss_weight = weight if loss_weight is None else loss_weight * weight
  common = dict(normalizer=normalizer, entropy=entropy, loss_weight=loss_weight)
  if name in ("ppo", "ppo_recompute"):
    old = behav_logp if name == "ppo" else prox_logp
    if old is None:
      raise ValueError("ppo_recompute needs prox_logp (the prox log-prob pass)")
    loss, metrics = naive_ppo_loss(logp, old, advantages, mask, eps_clip=eps_clip,
                                   dual_clip=corrections.dual_clip, **common)
    if name == "ppo_recompute":  # (the KL the staleness metrics mean: to the behaviour policy)
      log_prox = _safe_log_ratio(mask, jax.lax.stop_gradient(logp), jax.lax.stop_gradient(prox_logp))
      metrics.update(kl_prox=_k3(mask, log_prox), kl_behav=_k3(
          mask, _safe_log_ratio(mask, jax.lax.stop_gradient(logp), jax.lax.stop_gradient(behav_logp))),
                     kl_behav_prox=_k3(mask, _safe_log_ratio(mask, jax.lax.stop_gradient(prox_logp),
                                                             jax.lax.stop_gradient(behav_logp))))
  elif name == "decoupled_ppo":
    if prox_logp is None:
      raise ValueError("decoupled_ppo needs prox_logp (the prox log-prob pass)")
    loss, metrics = decoupled_ppo_loss(logp, prox_logp, behav_logp, advantages, mask, eps_clip=eps_clip,
                                       behav_weight_cap=behav_weight_cap,
                                       behav_weight_floor=behav_weight_floor,
                                       behav_weight_clip=behav_weight_clip,
                                       dual_clip=corrections.dual_clip, **common)
  elif name == "dis":
    loss, metrics = dis_loss(logp, behav_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high,
                             sign_aware=dis_sign_aware, **common)
  elif name == "gspo":
    if prox_logp is None:
      raise ValueError("gspo needs prox_logp (the prox log-prob pass)")
    loss, metrics = gspo_loss(logp, prox_logp, behav_logp, advantages, mask, eps_low=gspo_eps_low,
                              eps_high=gspo_eps_high, segment_ids=segment_ids,
                              behav_weight_cap=behav_weight_cap, behav_weight_floor=behav_weight_floor,
                              behav_weight_clip=behav_weight_clip, dual_clip=corrections.dual_clip,
                              **common)
  else:
    raise ValueError(f"rl.loss={name!r}: must be one of {LOSSES}")
  if corrections.reads_ratio:
    dropped = jnp.maximum(metrics["dropped"], zeroed.astype(jnp.float32))
    clipped = metrics["clipped"] * (1.0 - dropped)
    metrics.update(dropped=dropped, dropped_frac=_mean(mask, dropped), clipped=clipped,
                   clipped_frac=_mean(mask, clipped))
  return loss, metrics


KL_ESTIMATORS = ("k1", "k2", "k3")


def reference_kl(logp, ref_logp, mask, *, coef: float, estimator: str = "k3", normalizer=None,
                 loss_weight=None) -> tuple[jax.Array, Metrics]:
  """The KL penalty towards a reference policy (``rl.kl_coef``): ``coef * sum_t c_t k(t) / N`` over
  policy tokens, aggregated as the policy loss is (``loss_weight`` c, ``normalizer`` N), with a
  per-token estimate ``k`` of KL(pi_theta || pi_ref) on the sampled tokens, ``d = logp - ref_logp``:

  * ``k1 = d`` (unbiased, high variance, can be negative per token);
  * ``k2 = d^2 / 2`` (low variance, biased; its gradient is d * grad logp);
  * ``k3 = exp(-d) - 1 + d`` (GRPO's: unbiased under pi_theta's samples, >= 0; gradient
    (1 - exp(-d)) * grad logp).

  ``ref_logp`` carries no gradient. Returns the penalty (to add to the loss) and ``kl_ref`` (the
  k3 estimate, token mean, for the metrics)."""
  if estimator not in KL_ESTIMATORS:
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
  mask = jnp.asarray(mask, jnp.float32)
  ref_logp = jax.lax.stop_gradient(ref_logp)
  # d clamped at -MAX_LOG_RATIO below (so exp(-d) stays finite), as every ratio here is
  d = -_safe_log_ratio(mask, ref_logp, logp)
  per_token = {"k1": d, "k2": 0.5 * jnp.square(d), "k3": jnp.expm1(-d) + d}[estimator]
  penalty = coef * _weighted_sum(mask, loss_weight, per_token) / _normalizer(mask, normalizer)
  return penalty, {"kl_ref": _k3(mask, jax.lax.stop_gradient(-d))}


def needs_prox(name: str, corrections: Corrections = Corrections()) -> bool:
  """Whether the loss needs the prox log-probs (``decoupled_ppo``, ``ppo_recompute``, ``gspo``, or a
  correction that reads ``pi_prox / pi_behav``)."""
  return name in ("decoupled_ppo", "ppo_recompute", "gspo") or corrections.needs_prox

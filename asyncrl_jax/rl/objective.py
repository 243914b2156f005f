"""The learner's objective on one packed micro-batch: forward -> aligned log-probs -> policy loss."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from asyncrl_jax.models import moe as moe_lib
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.models.forward import Forward
from asyncrl_jax.models.sampling import SamplingSettings, in_support
from asyncrl_jax.rl import losses, selection
from asyncrl_jax.rl.batching import TokenBatch
from asyncrl_jax.rl.logprobs import token_logprobs


def _finite_or_none(x: float) -> Optional[float]:
  """A guard of ``inf`` is no guard at all (``None``: nothing traced for it)."""
  return x if math.isfinite(x) else None


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """Static (hashable) loss options, taken from the ``rl`` config section (and the learner's memory
  options ``learner.vocab_chunk`` and ``forward``: ``learner.attention``, ``.remat``,
  ``.attention_chunk``, ``.scan_layers``, which change how the forward pass runs, not what it
  computes)."""
  loss: str = "decoupled_ppo"
  eps_clip: float = 0.2
  eps_low: float = 0.3
  eps_high: float = 5.0
  behav_weight_cap: Optional[float] = None
  behav_weight_floor: Optional[float] = None
  behav_weight_clip: Optional[float] = None
  dis_sign_aware: bool = False
  gspo_eps_low: float = 3e-4
  gspo_eps_high: float = 4e-4
  corrections: losses.Corrections = losses.Corrections()
  # the distribution the behaviour log-probs were recorded in (SamplingSettings.recorded)
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  vocab_chunk: int = 0
  forward: Forward = Forward()
  # the stop tokens a minimum length bans (``TokenBatch.eos_banned`` says where); () when the run
  # sets no minimum length, so the forward pass has nothing more to do
  eos_ban_ids: tuple = ()
  # rl.kl_coef / rl.kl_estimator: the penalty towards the policy RL started from (0: none)
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  # a mixture-of-experts policy: the router's load-balancing loss times this (model.moe.aux_loss_coef);
  # ``route_shape`` (L_moe, k) when the batches carry the decode servers' routes
  # (rollout.record_routes), which the forward passes replay when ``replay_routes`` (rl.replay_routes)
  moe_aux_coef: float = 0.0
  route_shape: Optional[tuple] = None
  replay_routes: bool = False

  @classmethod
  def from_config(cls, config, stop_ids=()) -> "LossSettings":
    """``stop_ids``: the run's tokenizer's stop tokens (read by the caller: the maths reads no files),
    needed when the run sets a minimum length (``has_min_length``)."""
    if has_min_length(config) and not stop_ids:
      raise ValueError("the run sets a minimum length (rollout.min_new_tokens or rollout.length_workload): "
                       "the loss needs the tokenizer's stop_ids to ban them where the decode server did")
    temperature, top_k, top_p = SamplingSettings.from_config(config).recorded()
    return cls(loss=config.rl.loss, eps_clip=config.rl.eps_clip, eps_low=config.rl.eps_low,
               eps_high=config.rl.eps_high,
               behav_weight_cap=_finite_or_none(config.rl.behav_weight_cap),
               behav_weight_floor=config.rl.behav_weight_floor or None,
               behav_weight_clip=_finite_or_none(config.rl.behav_weight_clip),
               dis_sign_aware=bool(config.rl.dis_sign_aware),
               gspo_eps_low=float(config.rl.gspo_eps_low),
               gspo_eps_high=float(config.rl.gspo_eps_high),
               corrections=corrections_from_config(config),
               temperature=temperature, top_k=top_k, top_p=top_p,
               vocab_chunk=int(config.learner.vocab_chunk),
               forward=Forward.from_learner(config),
               eos_ban_ids=eos_ban_ids(config, stop_ids),
               kl_coef=float(config.rl.kl_coef), kl_estimator=str(config.rl.kl_estimator),
               **moe_settings(config))


  @property
  def needs_prox(self) -> bool:
    """Whether the objective or a correction reads the prox log-probs."""
    return losses.needs_prox(self.loss, self.corrections)


def moe_settings(config) -> dict:
  """``LossSettings``' mixture-of-experts fields from the config (none for a dense model)."""
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  model = models.config_of(config)
  if not model.moe:
    return {}
  recorded = bool(config.rollout.record_routes)
  return {"moe_aux_coef": float(config.model.moe.aux_loss_coef),
          "route_shape": model.route_shape if recorded else None,
          "replay_routes": recorded and bool(config.rl.replay_routes)}


def _interval(low: float, high: float) -> Optional[tuple]:
  """``(low, high)``, or None when it excludes nothing (0, inf)."""
  return None if low <= 0 and not math.isfinite(high) else (float(low), float(high))


def corrections_from_config(config) -> losses.Corrections:
  """``rl.correction`` as the loss's ``Corrections`` (inf / 0 bounds are off)."""
  c = config.rl.correction
  return losses.Corrections(ratio=c.ratio, tis_cap=_finite_or_none(c.tis_cap),
                            icepop=_interval(c.icepop_low, c.icepop_high),
                            seq_mask=_interval(c.seq_mask_low, c.seq_mask_high),
                            dual_clip=_finite_or_none(c.dual_clip))


def has_min_length(config) -> bool:
  """Whether the run's requests can carry a minimum length (``rollout.min_new_tokens`` or
  ``rollout.length_workload``), which bans the stop tokens until it is reached."""
  return bool(config.rollout.min_new_tokens or config.rollout.length_workload)


def eos_ban_ids(config, stop_ids) -> tuple:
  """The tokenizer's ``stop_ids`` when the run's requests can carry a minimum length, else ()."""
  return tuple(sorted(int(i) for i in stop_ids)) if has_min_length(config) else ()


def micro_batch_loss(params, batch: TokenBatch, prox_logp, normalizer, *, model: ModelConfig,
                     settings: LossSettings, mesh: Optional[Mesh] = None, prox_is_current: bool = False,
                     ref_logp=None):
  """Loss of one micro-batch, normalised by the *global* policy-token count ``normalizer``.

  Summing this over the micro-batches of a global batch (and their gradients) gives exactly the token
  mean over the global batch. ``prox_logp`` ([R, L], or None unless the loss needs it) comes
  from ``compute_logprobs`` under the weights before the update. ``prox_is_current=True`` says that
  ``params`` *are* those weights (the first optimizer update of a version): the prox log-probs are then
  this forward pass's own, held constant, and no separate prox pass is needed (``prox_logp`` must be
  None). ``ref_logp`` ([R, L]): the reference policy's log-probs, for the KL penalty
  (``settings.kl_coef`` > 0, which needs them).
  """
  if settings.kl_coef and ref_logp is None:
    raise ValueError("rl.kl_coef > 0 needs the reference policy's log-probs (ref_logp)")
  if prox_is_current and prox_logp is not None:
    raise ValueError("prox_is_current=True computes the prox log-probs; do not pass prox_logp")
  result = token_logprobs(model, params, batch.tokens, batch.positions, batch.segment_ids,
                          temperature=settings.temperature, top_k=settings.top_k,
                          top_p=settings.top_p, mesh=mesh, with_entropy=True,
                          forward=settings.forward, vocab_chunk=settings.vocab_chunk,
                          eos_banned_bt=batch.eos_banned, eos_ban_ids=settings.eos_ban_ids,
                          routes_btlk=batch.routes if settings.replay_routes else None,
                          with_moe=model.moe)
  logp, entropy, moe_out = result if model.moe else (*result, None)
  if prox_is_current:
    prox_logp = jax.lax.stop_gradient(logp) if settings.needs_prox else None
  # A sampled token outside the truncated (top-k / top-p) set of the current or the prox weights
  # has probability 0 there: weight 0, kept in the normaliser like any dropped token.
  supported = in_support(logp) if prox_logp is None else in_support(logp) & in_support(prox_logp)
  mask = jnp.where(supported, batch.mask, 0.0)
  loss, metrics = losses.policy_loss(
      settings.loss, logp=logp, behav_logp=batch.behav_logp, prox_logp=prox_logp,
      advantages=batch.advantages, mask=mask, eps_clip=settings.eps_clip,
      eps_low=settings.eps_low, eps_high=settings.eps_high,
      behav_weight_cap=settings.behav_weight_cap, behav_weight_floor=settings.behav_weight_floor,
      behav_weight_clip=settings.behav_weight_clip, dis_sign_aware=settings.dis_sign_aware,
      gspo_eps_low=settings.gspo_eps_low, gspo_eps_high=settings.gspo_eps_high,
      corrections=settings.corrections, segment_ids=batch.segment_ids,
      normalizer=normalizer, loss_weight=batch.loss_weight,
      entropy=jax.lax.stop_gradient(entropy))
  if settings.kl_coef:
    penalty, kl = losses.reference_kl(logp, ref_logp, mask, coef=settings.kl_coef,
                                      estimator=settings.kl_estimator, normalizer=normalizer,
                                      loss_weight=batch.loss_weight)
    loss = loss + penalty
    metrics.update(kl, kl_ref_penalty=jax.lax.stop_gradient(penalty))
  policy_tokens = jnp.sum(batch.mask)
  if moe_out is not None:
    loss = loss + _moe_terms(moe_out, batch, settings, policy_tokens / normalizer, metrics)
  outside = batch.mask - mask
  # rl.selection: every policy token given weight 0, counted by its sequence's length and its
  # staleness (the learner places each token's staleness in ``versions``: ``batching.with_staleness``)
  zeroed = jnp.maximum(metrics.pop("dropped"), outside)
  clipped = metrics.pop("clipped")
  log_ratio_behav = jax.lax.stop_gradient(
      jnp.where(batch.mask > 0, logp, 0.0) - jnp.where(batch.mask > 0, batch.behav_logp, 0.0))
  metrics.update(policy_tokens=policy_tokens,
                 ratio_max=jnp.exp(jnp.minimum(jnp.max(jnp.where(batch.mask > 0, log_ratio_behav, -jnp.inf)),
                                               losses.MAX_LOG_RATIO)),
                 outside_support_frac=jnp.sum(outside) / jnp.maximum(policy_tokens, 1.0),
                 selection=selection.device_counts(zeroed, batch.mask, batch.versions, batch.segment_ids,
                                                   log_ratio=log_ratio_behav,
                                                   advantages=batch.advantages, clipped=clipped))
  return loss, metrics


def _moe_terms(moe_out, batch: TokenBatch, settings: LossSettings, share, metrics: dict):
  """The router's load-balancing term of a mixture-of-experts policy (``settings.moe_aux_coef`` times
  the loss averaged over MoE layers, weighted by the micro-batch's ``share`` of the global batch's
  policy tokens, so that the micro-batches sum to a token-weighted mean) and its metrics, added to
  ``metrics``: ``moe_aux_loss`` (1 when balanced), ``moe_load_max`` (the busiest expert's share of
  the routing slots times E: 1 when balanced), ``moe_dropped_frac`` (the share of routing slots the
  expert exchange's capacity dropped: 0 when dropless), ``moe_load/<e>`` (each expert's share, averaged over
  layers), and with recorded routes ``moe_route_mismatch``: the fraction of (token, layer) pairs
  whose learner top k differs from the decode server's."""
  load_e = jnp.mean(moe_out.load, axis=0)
  num_experts = load_e.shape[0]
  metrics.update(moe_aux_loss=jax.lax.stop_gradient(moe_out.aux_loss),
                 moe_load_max=jax.lax.stop_gradient(jnp.max(load_e) * num_experts),
                 moe_dropped_frac=jax.lax.stop_gradient(moe_out.dropped),
                 **{f"moe_load/{e}": jax.lax.stop_gradient(load_e[e]) for e in range(num_experts)})
  if batch.routes is not None:
    metrics["moe_route_mismatch"] = moe_lib.route_mismatch(moe_out.own_routes, batch.routes,
                                                           batch.segment_ids > 0)
  if not settings.moe_aux_coef:
    return 0.0
  return settings.moe_aux_coef * moe_out.aux_loss * share

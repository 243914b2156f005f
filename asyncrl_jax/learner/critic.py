"""The learner's critic for single-rollout advantages (SAO, ``rl.advantage="value"``).

A value model (``models.value``: the policy's trunk and a scalar head) on the learner mesh, with its
own optimizer in the shared update loop. Per policy version, on the batch's packed micro-batches:

1. ``estimate``: one forward pass of the value model before any update gives ``V(s_t)`` on every
   policy token, and GAE over the packed rows (``rl.gamma``, ``rl.gae_lambda``) turns the per-token
   rewards into advantages and returns. With gamma = lambda = 1 and the reward on a trajectory's last
   token this is ``A_t = R - V(s_t)``: no advantage needs another trajectory, so there is no group
   barrier (``rl.group_size=1`` is allowed).
2. the policy update uses those advantages (``learner.Learner.train``);
3. ``train``: ``rl.value_updates`` optimizer steps of the clipped value loss on the returns, the
   old values being the estimate's.

In value mode a batch's ``advantages`` field holds per-token *rewards* (the controller puts each
trajectory's reward on its last completion token, ``batching.make_sequence(token_reward=...)``):
rewards are what the decode side knows; advantages are what only the learner's critic can compute.
Every trajectory is treated as terminated (its reward is final, a truncated one included), so nothing
is bootstrapped past its last token.

The critic's state is checkpointed with the run and never offered to decode servers.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from asyncrl_jax import models
from asyncrl_jax.infra import sharding as sharding_lib
from asyncrl_jax.learner import updater as update_lib
from asyncrl_jax.models import value as value_lib
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.models.forward import Forward
from asyncrl_jax.rl import advantages as adv_lib, batching


def value_moments(values, returns, mask) -> jax.Array:
  """``[6]`` float32 statistics of the tokens with ``mask`` (arrays of one shape), centred so that
  nothing cancels: count, mean and sum of squared deviations of the returns, the same of ``returns -
  values``, and the mean value. A jitted call returns them replicated, so every process can read them
  (the token arrays they summarise may span other processes' devices); ``merge_moments`` combines
  those of several micro-batches."""
  m = jnp.asarray(mask) > 0
  n = jnp.sum(m.astype(jnp.float32))
  r = jnp.asarray(returns, jnp.float32)
  d = r - jnp.asarray(values, jnp.float32)

  def mean_m2(x):
    mean = jnp.sum(jnp.where(m, x, 0.0)) / jnp.maximum(n, 1.0)
    return mean, jnp.sum(jnp.where(m, jnp.square(x - mean), 0.0))

  (mr, m2r), (md, m2d) = mean_m2(r), mean_m2(d)
  return jnp.stack([n, mr, m2r, md, m2d, mr - md])  # (the mean value: mean r - mean (r - v))


def merge_moments(parts) -> np.ndarray:
  """``value_moments`` of several parts (``[k, 6]``) as one, in float64 (Chan et al.'s pairwise
  update of the means and sums of squared deviations)."""
  total = np.zeros(6, np.float64)
  for part in np.asarray(parts, np.float64).reshape(-1, 6):
    n_b = part[0]
    if n_b <= 0:
      continue
    n_a, n = total[0], total[0] + part[0]
    out = np.empty(6)
    out[0] = n
    for mean, m2 in ((1, 2), (3, 4)):
      delta = part[mean] - total[mean]
      out[mean] = total[mean] + delta * n_b / n
      out[m2] = total[m2] + part[m2] + delta * delta * n_a * n_b / n
    out[5] = total[5] + (part[5] - total[5]) * n_b / n
    total = out
  return total


def value_metrics(moments) -> dict:
  """Host figures of a value model from ``merge_moments``: ``value_explained_variance`` (``1 -
  Var(returns - values) / Var(returns)``, 0 when the returns do not vary, as
  ``models.value.explained_variance``), ``value_mean``, ``return_mean``."""
  n, mean_r, m2_r, _, m2_d, mean_v = (float(x) for x in np.asarray(moments, np.float64))
  if n <= 0:
    return {"value_explained_variance": 0.0, "value_mean": 0.0, "return_mean": 0.0}
  # (a spread of the returns at float32's rounding of their mean is no spread)
  varies = m2_r / n > (1e-6 * max(abs(mean_r), 1e-12)) ** 2
  ev = 1.0 - m2_d / m2_r if varies else 0.0
  return {"value_explained_variance": ev, "value_mean": mean_v, "return_mean": mean_r}


class Critic:
  """The value model's params and optimizer state on ``mesh``; ``estimate`` and ``train`` per version.

  Args:
    model_config: the policy's model (the trunk's architecture).
    policy_params: the policy the value model starts from (its trunk is a copy; the head is zero).
    mesh: the learner mesh.
    config: the run config (``rl.gamma``, ``rl.gae_lambda``, ``rl.value_*``, ``learner.*``).
    versions: the policy versions the run trains (``rl.value_updates`` optimizer steps each).
    forward: the learner's options for the forward pass (``models.forward``).
  """

  def __init__(self, model_config: ModelConfig, policy_params, mesh: Mesh, config, *,
               versions: int, forward: Forward = Forward()):
    rl = config.rl
    self.model_config, self.mesh = model_config, mesh
    self.gamma, self.lam = float(rl.gamma), float(rl.gae_lambda)
    self.updates, self.clip = int(rl.value_updates), float(rl.value_clip)
    self.pretrain_versions = int(rl.value_pretrain_versions)
    self._forward = dict(mesh=mesh, forward=forward)
    params = (jax.eval_shape(value_lib.init_value_params, policy_params)
              if update_lib.is_abstract(policy_params) else value_lib.init_value_params(policy_params))
    base = update_lib.make_optimizer(
        learning_rate=rl.value_learning_rate, total_steps=versions * self.updates,
        grad_clip=config.learner.grad_clip, schedule="constant", b1=config.learner.b1,
        b2=config.learner.b2, weight_decay=config.learner.weight_decay)
    optimizer = value_lib.value_optimizer(base, params, freeze_attention=bool(rl.value_freeze_attention))
    replicated = sharding_lib.replicated(mesh)
    shardings = {"trunk": models.param_shardings(model_config, mesh),
                 "head": {"w": replicated, "b": replicated}}
    self.updater = update_lib.Updater(model_config, params, mesh, optimizer,
                                      {"value": self._loss}, token_budget=config.learner.token_budget,
                                      param_shardings=shardings)
    self._estimate = self.updater.jit_forward(
        functools.partial(self._estimate_impl, lam=self.lam), "value_estimate")
    # held-out figures: the returns at lambda = 1 (reward to go), which do not depend on the values
    self._reward_to_go = self.updater.jit_forward(
        functools.partial(self._estimate_impl, lam=1.0), "value_reward_to_go")
    self._moments = jax.jit(lambda estimate, mask: value_moments(estimate[2], estimate[1], mask),
                            out_shardings=replicated)

  def reset(self, policy_params) -> None:
    """Starts the value model again from ``policy_params`` (e.g. the policy after its supervised warm
    start): the trunk a copy of them, the head zero. The optimizer state is not touched (a fresh
    critic's is the initial one)."""
    self.params = jax.device_put(value_lib.init_value_params(policy_params),
                                 self.updater.param_shardings)

  params = property(lambda self: self.updater.params,
                    lambda self, v: setattr(self.updater, "params", v))
  opt_state = property(lambda self: self.updater.opt_state,
                       lambda self, v: setattr(self.updater, "opt_state", v))

  def _values(self, params, batch: batching.TokenBatch):
    return value_lib.token_values(self.model_config, params, batch.tokens, batch.positions,
                                  batch.segment_ids, **self._forward)

  def _estimate_impl(self, params, batch: batching.TokenBatch, *, lam: float):
    """``(advantages, returns, values)``, each ``[R, L]`` and 0 off the policy tokens; the batch's
    ``advantages`` field holds the per-token rewards."""
    values = self._values(params, batch)
    rows = batch.tokens.shape[0]
    adv, returns = adv_lib.gae(batch.advantages, values, batch.mask, jnp.ones((rows,), bool),
                               jnp.zeros((rows,), jnp.float32), gamma=self.gamma, lam=lam,
                               segment_ids_bt=batch.segment_ids)
    return adv, returns, jnp.where(batch.mask > 0, values, 0.0)

  def _loss(self, params, batch: batching.TokenBatch, aux, normalizer):
    old_values, returns = aux
    loss = adv_lib.clipped_value_loss(self._values(params, batch), old_values, returns, batch.mask,
                                      clip_eps=self.clip, normalizer=normalizer)
    return loss, {"policy_tokens": jnp.sum(batch.mask)}

  def programs(self, batch) -> list:
    """``(name, jitted function, arguments)`` of every program a version runs for the value model on
    micro-batches shaped like ``batch``: its estimate pass and its update's (``Updater.programs``)."""
    rows_len = jax.ShapeDtypeStruct(batch.tokens.shape, jnp.float32, sharding=batch.tokens.sharding)
    out = [("value_estimate", self._estimate, (self.params, batch))]
    return out + [(f"value_{name}", fn, args) for name, fn, args in
                  self.updater.programs(batch, {"value": (rows_len, rows_len)})]

  def estimate(self, micro_batches: Sequence[batching.TokenBatch]) -> list:
    """Per micro-batch (placed by the learner's updater, same mesh and budget): ``(advantages,
    returns, values)`` on device, under the current value model."""
    return [self._estimate(self.params, b) for b in micro_batches]

  def train(self, micro_batches: Sequence[batching.TokenBatch], estimates: Sequence, normalizer
            ) -> tuple[list, list]:
    """``rl.value_updates`` optimizer steps on the returns of ``estimates`` (``estimate``'s, for the
    same micro-batches); returns each step's per-micro-batch metrics and health, on device."""
    aux = [(values, returns) for _, returns, values in estimates]
    per_step, health = [], []
    for _ in range(self.updates):
      metrics, h = self.updater.update(micro_batches, normalizer, loss="value", aux=aux,
                                       proceed=health[-1]["applied"] if health else None)
      per_step.append(metrics)
      health.append(h)
    return per_step, health

  def moments(self, micro_batches: Sequence[batching.TokenBatch], estimates: Sequence) -> list:
    """``value_moments`` of ``estimates`` (``estimate``'s, for the same micro-batches) per
    micro-batch, on device and replicated."""
    return [self._moments(e, b.mask) for b, e in zip(micro_batches, estimates)]

  def explained_variance(self, sequences: Sequence[batching.SequenceData]) -> dict:
    """``value_metrics`` of the current value model on ``sequences`` (per-token rewards in their
    ``advantages`` field), e.g. held-out samples: returns from GAE at lambda = 1 (the discounted
    reward to go, which does not depend on the values)."""
    mbs, _ = self.updater.place(sequences)
    parts = jax.device_get(self.moments(mbs, [self._reward_to_go(self.params, b) for b in mbs]))
    return value_metrics(merge_moments(parts))


def host_value_metrics(per_step: list, health: list, moments: list) -> dict:
  """A version's value figures from ``Critic.train``'s results and ``Critic.moments`` of the estimates
  (device_get already applied): ``value_loss`` (the first step's, i.e. on data the value model has not
  trained on), ``value_loss_last_update`` (the last step's), ``value_grad_norm``, and
  ``value_metrics`` of the estimates against their returns."""
  first = sum(float(m["loss"]) for m in per_step[0])
  last = sum(float(m["loss"]) for m in per_step[-1])
  out = {"value_loss": first, "value_loss_last_update": last,
         "value_grad_norm": float(np.mean([h["grad_norm"] for h in health]))}
  out.update(value_metrics(merge_moments(moments)))
  return out


def check_finite(metrics: dict, health: list, version: int) -> Optional[str]:
  """What was not finite in the critic's version (a message), or None."""
  for i, h in enumerate(health):
    if not (np.isfinite(h["grad_norm"]) and np.isfinite(h["param_norm"])):
      return (f"the value model's update {i + 1} of {len(health)} at version {version} (gradient norm "
              f"{h['grad_norm']}, parameter norm {h['param_norm']})")
  bad = [k for k, v in metrics.items() if not np.isfinite(v)]
  return f"the value model's {bad[0]} at version {version}" if bad else None

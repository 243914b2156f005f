"""The learner: sharded params and optimizer state, prox pass, chosen loss, dynamic micro-batches.

One ``train(sequences)`` call is one policy version: the global batch is packed into fixed-shape
micro-batches under ``learner.token_budget``, then ``learner.ppo_minibatches`` optimizer updates each
sum the gradients of their micro-batches (normalised by the global policy-token count of that
minibatch, so each token weighs the same; ``rl.aggregation='sequence_mean'`` makes each trajectory
weigh the same). Decoupled PPO's prox log-probs are those of the weights before the version's first
update: the first minibatch reads them off its own forward pass (held constant), and only later
minibatches need a separate prox pass, run before any update; with the default single minibatch there
is no prox pass at all.
Everything on device is jitted with explicit shardings; params and optimizer state are donated.
"""

from __future__ import annotations

import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from asyncrl_jax import models
from asyncrl_jax import sharding as sharding_lib
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.rl import batching, losses
from asyncrl_jax.rl.logprobs import token_logprobs
from asyncrl_jax.rl.objective import LossSettings, micro_batch_loss


def idle_fraction(learner_seconds: float, seconds: float) -> float:
  """Share of ``seconds`` of wall time in which the learner was not updating (``learner_seconds``
  busy): the one definition the main job's metrics and the benchmarks use."""
  return max(0.0, 1.0 - learner_seconds / max(seconds, 1e-9))


def make_optimizer(learner_config, total_steps: int) -> optax.GradientTransformation:
  """AdamW with global-norm clipping and linear warmup then cosine decay to 10%."""
  lr = learner_config.learning_rate
  warmup = learner_config.warmup_steps
  if warmup:
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total_steps, warmup + 1), lr * 0.1)
  else:
    schedule = optax.cosine_decay_schedule(lr, max(total_steps, 1), alpha=0.1)
  return optax.chain(
      optax.clip_by_global_norm(learner_config.grad_clip),
      optax.adamw(schedule, b1=learner_config.b1, b2=learner_config.b2,
                  weight_decay=learner_config.weight_decay))


class Learner:
  """Holds the trainable state on the learner mesh and runs one update per global batch."""

  def __init__(self, model_config: ModelConfig, params, mesh: Mesh, config, *, total_steps: int,
               opt_state=None, version: int = 0):
    self.model_config = model_config
    self.mesh = mesh
    self.settings = LossSettings.from_config(config)
    self.token_budget = config.learner.token_budget
    self.minibatches = config.learner.ppo_minibatches
    self.aggregation = config.rl.aggregation
    self.version = version
    self.optimizer = make_optimizer(config.learner, total_steps)
    self.param_shardings = models.param_shardings(model_config, mesh)
    # A private copy: updates donate these buffers, and the caller may still hold the ones it passed.
    self.params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.param_shardings)(
        jax.device_put(params, self.param_shardings))
    if opt_state is None:
      opt_state = jax.jit(self.optimizer.init)(self.params)
    # Scalars (step counts) are created on the default device; keep every leaf on the learner mesh.
    replicated = sharding_lib.replicated(mesh)
    self.opt_state = jax.tree.map(
        lambda x: x if x.ndim and getattr(x.sharding, "mesh", None) == mesh else
        jax.device_put(x, replicated), opt_state)
    self._rows_multiple = mesh.shape["data"] * mesh.shape["fsdp"]
    self._batch_sharding = sharding_lib.batch_sharding(mesh, 2)
    self._grad = jax.jit(self._grad_impl, static_argnames=("prox_is_current",))
    self._prox = jax.jit(self._prox_impl)
    self._apply = jax.jit(self._apply_impl, donate_argnums=(0, 1))
    self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=(0,))

  def _prox_impl(self, params, batch):
    return token_logprobs(self.model_config, params, batch.tokens, batch.positions, batch.segment_ids,
                          temperature=self.settings.temperature, mesh=self.mesh)

  def _grad_impl(self, params, batch, prox, normalizer, prox_is_current=False):
    fn = functools.partial(micro_batch_loss, batch=batch, prox_logp=prox, normalizer=normalizer,
                           model=self.model_config, settings=self.settings, mesh=self.mesh,
                           prox_is_current=prox_is_current)
    (loss, metrics), grads = jax.value_and_grad(fn, has_aux=True)(params)
    return loss, metrics, grads

  def _apply_impl(self, params, opt_state, grads):
    updates, opt_state = self.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.global_norm(grads)

  def _device_batch(self, b: batching.TokenBatch):
    return jax.device_put(batching.pad_rows(b, self._rows_multiple), self._batch_sharding)

  def train(self, sequences: Sequence[batching.SequenceData]) -> dict:
    """One policy version from a global batch; returns metrics (host floats).

    Nothing is read back from the device until the last update has been dispatched, so the host
    never stalls the micro-batch pipeline.
    """
    t0 = time.perf_counter()
    chunks = np.array_split(np.arange(len(sequences)), min(self.minibatches, len(sequences)))
    plans, normalizers = [], []
    for idx in chunks:
      chunk = [sequences[i] for i in idx]
      if self.aggregation == "sequence_mean":
        chunk = batching.weight_sequences_equally(chunk)
      host_mbs = batching.pack_sequences(chunk, self.token_budget)
      normalizers.append(jnp.float32(max(batching.total_policy_tokens(host_mbs), 1.0)))
      plans.append([self._device_batch(b) for b in host_mbs])
    # Prox log-probs under the weights before this version's first update: the first minibatch's come
    # from its own forward pass (prox_is_current), the others' from a prox pass run now.
    needs_prox = losses.needs_prox(self.settings.loss)
    prox = [[self._prox(self.params, b) if needs_prox and i else None for b in mbs]
            for i, mbs in enumerate(plans)]
    per_mb, grad_norms = [], []
    for i, (mbs, prox_mbs, normalizer) in enumerate(zip(plans, prox, normalizers)):
      grads = None
      for b, p in zip(mbs, prox_mbs):
        loss, metrics, g = self._grad(self.params, b, p, normalizer, prox_is_current=needs_prox and not i)
        grads = g if grads is None else self._add(grads, g)
        per_mb.append(dict(metrics, loss=loss))
      self.params, self.opt_state, gnorm = self._apply(self.params, self.opt_state, grads)
      grad_norms.append(gnorm)
    per_mb, grad_norms = jax.device_get((per_mb, grad_norms))
    totals = {}
    for metrics in per_mb:
      weight = float(metrics.pop("policy_tokens"))
      for k, v in metrics.items():
        # loss is already globally normalised per micro-batch: sum it; others: token-weighted mean
        totals.setdefault(k, []).append((float(v), 1.0 if k == "loss" else weight))
    self.version += 1
    out = {}
    for k, vals in totals.items():
      if k == "loss":
        out[k] = sum(v for v, _ in vals) / len(plans)
      elif k == "iw_max":
        out[k] = max(v for v, _ in vals)
      else:
        w = sum(x for _, x in vals)
        out[k] = sum(v * x for v, x in vals) / max(w, 1.0)
    for k, v in out.items():
      if not np.isfinite(v):
        raise FloatingPointError(f"non-finite {k}={v} at policy version {self.version - 1}")
    out.update(grad_norm=float(np.mean(grad_norms)), learner_seconds=time.perf_counter() - t0,
               micro_batches=sum(len(m) for m in plans), version=self.version)
    return out

"""The learner: the RL policy's trainable state, its version count, and one update per global batch.

One ``train(sequences, version=v)`` call is one policy version: the global batch (trained at version
``v``, which must be the learner's own) is split into ``learner.ppo_minibatches`` minibatches, each
packed into fixed-shape micro-batches under ``learner.token_budget`` and applied as one optimizer
update of the shared update loop (``asyncrl_jax.learner.updater``), normalised by that minibatch's policy-token
count so each token weighs the same (``rl.aggregation='sequence_mean'`` sets per-token loss weights so
that each trajectory weighs the same). Decoupled PPO's prox log-probs are those of the weights before
the version's first update: the first minibatch reads them off its own forward pass (held constant),
and only later minibatches need a separate prox pass, run before any update; with the default single
minibatch there is no prox pass at all.

With ``rl.advantage="value"`` the learner also owns a critic (``asyncrl_jax.learner.critic``): per version it
turns the batch's per-token rewards into advantages with the value model before any update, the
policy trains on those, and the value model then takes its own optimizer steps; the first
``rl.value_pretrain_versions`` versions train the value model alone.

``Learner.version`` is the only count of trained versions in the system: batches name the version
they train, decode servers the version they hold, and both are checked against it.
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from asyncrl_jax.infra import bucketing
from asyncrl_jax.learner import critic as critic_lib, updater as update_lib
from asyncrl_jax.models import lora
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.rl import batching, selection
from asyncrl_jax.rl.logprobs import token_logprobs
from asyncrl_jax.rl.objective import LossSettings, has_min_length, micro_batch_loss
from asyncrl_jax.rl.staleness import VersionMismatch
from asyncrl_jax.tokenization import tokenizer_of


def idle_fraction(learner_seconds: float, seconds: float) -> float:
  """Share of ``seconds`` of wall time in which the learner was not updating (``learner_seconds``
  busy): the one definition the main job's metrics and the benchmarks use."""
  return max(0.0, 1.0 - learner_seconds / max(seconds, 1e-9))


def policy_updates(config, versions: int) -> int:
  """The optimizer updates the policy takes over a run of ``versions`` policy versions:
  ``learner.ppo_minibatches`` per version, except the first ``rl.value_pretrain_versions`` in value
  mode (they train the value model alone). The learning-rate schedule runs over exactly these."""
  trained = versions
  if config.rl.advantage == "value":
    trained = versions - min(int(config.rl.value_pretrain_versions), versions)
  return max(1, trained * int(config.learner.ppo_minibatches))


def learning_rate_schedule(config, versions: int):
  """The policy's learning rate against its optimizer step count (``update.learning_rate_schedule``
  over ``policy_updates``)."""
  c = config.learner
  return update_lib.learning_rate_schedule(learning_rate=c.learning_rate,
                                           total_steps=policy_updates(config, versions),
                                           warmup_steps=c.warmup_steps)


def make_optimizer(config, versions: int, schedule=None, *, adapters_only: bool = False):
  """The RL optimizer from the ``learner`` config section, at ``schedule`` (default
  ``learning_rate_schedule(config, versions)``: over ``policy_updates``); ``adapters_only``: the
  policy carries LoRA adapters and only they are trained."""
  c = config.learner
  return update_lib.make_optimizer(
      learning_rate=learning_rate_schedule(config, versions) if schedule is None else schedule,
      total_steps=policy_updates(config, versions), grad_clip=c.grad_clip, b1=c.b1, b2=c.b2,
      weight_decay=c.weight_decay, adapters_only=adapters_only)


def _combine(per_mb: list, num_updates: int) -> dict:
  """Host metrics of one version from its micro-batches': the loss (already globally normalised per
  micro-batch) summed and averaged over updates, ``iw_max`` and ``ratio_max`` the max, the rest
  token-weighted means."""
  totals = {}
  for metrics in per_mb:
    weight = float(metrics.pop("policy_tokens"))
    for k, v in metrics.items():
      totals.setdefault(k, []).append((float(v), 1.0 if k in ("loss", "kl_ref_penalty") else weight))
  out = {}
  for k, vals in totals.items():
    if k in ("loss", "kl_ref_penalty"):  # (globally normalised per micro-batch)
      out[k] = sum(v for v, _ in vals) / num_updates
    elif k in ("iw_max", "ratio_max"):
      out[k] = max(v for v, _ in vals)
    else:
      out[k] = sum(v * x for v, x in vals) / max(sum(x for _, x in vals), 1.0)
  return out


class NonFiniteError(FloatingPointError):
  """A loss, gradient or parameter of a version was NaN or inf (the message names which)."""


def run_stop_ids(config) -> tuple:
  """The run's tokenizer's stop tokens where the loss needs them (a minimum length bans them), else ()."""
  if not has_min_length(config):
    return ()
  return tuple(tokenizer_of(config).stop_ids)


class Learner:
  """The policy's params and optimizer state on the learner mesh, and the count of trained versions."""

  def __init__(self, model_config: ModelConfig, params, mesh: Mesh, config, *, versions: int,
               opt_state=None, version: int = 0):
    """``versions``: the policy versions the run trains (``config.steps``), for the optimizer's
    learning-rate schedule (which counts optimizer updates: ``policy_updates``)."""
    self.model_config = model_config
    self.mesh = mesh
    self.settings = LossSettings.from_config(config, stop_ids=run_stop_ids(config))
    self.minibatches = config.learner.ppo_minibatches
    self.aggregation = config.rl.aggregation
    self.version = version
    self._schedule = learning_rate_schedule(config, versions)  # (what the optimizer runs at, and logs)
    self.optimizer = make_optimizer(config, versions, self._schedule, adapters_only=model_config.lora)
    loss = functools.partial(micro_batch_loss, model=model_config, settings=self.settings, mesh=mesh)
    self.updater = update_lib.Updater(
        model_config, params, mesh, self.optimizer, token_budget=config.learner.token_budget,
        opt_state=opt_state, adapters_only=model_config.lora, route_shape=self.settings.route_shape,
        losses={
            # the version's first update: its own forward pass gives the prox log-probs; ``aux``
            # holds the reference's log-probs ("ref", with rl.kl_coef) and, for later updates, the
            # prox pass's ("prox")
            "first": lambda p, b, aux, n: loss(p, b, None, n, prox_is_current=self.settings.needs_prox,
                                               ref_logp=aux["ref"] if aux else None),
            "later": lambda p, b, aux, n: loss(p, b, (aux or {}).get("prox"), n,
                                               ref_logp=(aux or {}).get("ref"))})
    # the prox pass; with rl.kl_coef also the reference's (the same program on the reference's weights)
    self._prox = self.updater.jit_forward(self._prox_impl, "prox_logprobs")
    # rl.kl_coef: the policy RL started from (its trained part: every weight, or the LoRA adapters
    # over the frozen base), set again after a warm start (``set_reference``) or restored with a
    # checkpoint; None without the term
    self.reference = None
    if self.settings.kl_coef:
      self.set_reference()
    # rl.advantage="value": the critic turns each batch's per-token rewards into advantages
    self.critic = critic_lib.Critic(
        model_config, params, mesh, config, versions=versions,
        forward=self.settings.forward) if config.rl.advantage == "value" else None

  # The state lives in the update loop; these are the names the rest of the system uses.
  params = property(lambda self: self.updater.params,
                    lambda self, v: setattr(self.updater, "params", v))
  opt_state = property(lambda self: self.updater.opt_state,
                       lambda self, v: setattr(self.updater, "opt_state", v))
  param_shardings = property(lambda self: self.updater.param_shardings)

  def checkpoint_state(self) -> dict:
    """What a checkpoint holds of the learner: the policy's params and optimizer state, and the
    critic's when there is one (never sent to decode servers). With LoRA the policy's part is its
    ``adapters`` alone: the frozen base is the run's to keep once (``RunCheckpointer.keep_base``)."""
    if self.model_config.lora:
      state = {"adapters": lora.split_nested(self.params)[0], "opt_state": self.opt_state}
    else:
      state = {"params": self.params, "opt_state": self.opt_state}
    if self.critic is not None:
      state.update(value_params=self.critic.params, value_opt_state=self.critic.opt_state)
    return state

  def load_checkpoint_state(self, state: dict) -> None:
    """Takes ``state`` (shaped like ``checkpoint_state()``, on the same shardings) as the learner's;
    LoRA adapters go over the base the learner holds."""
    if "adapters" in state:
      self.params = lora.join_nested(state["adapters"], self.base_params())
    else:
      self.params = state["params"]
    self.opt_state = state["opt_state"]
    if self.critic is not None:
      self.critic.params, self.critic.opt_state = state["value_params"], state["value_opt_state"]

  def set_reference(self) -> None:
    """The current policy becomes the KL penalty's reference (``rl.kl_coef``): a copy of its
    trained part (every weight; with LoRA the adapters, the base being frozen)."""
    part = lora.split_nested(self.params)[0] if self.model_config.lora else self.params
    self.reference = part if self.updater.abstract else jax.tree.map(jnp.copy, part)

  def reference_params(self) -> dict:
    """The KL reference's whole parameters (with LoRA: its adapters over the base)."""
    if self.reference is None:
      raise ValueError("rl.kl_coef > 0 but the learner holds no reference policy (set_reference)")
    if self.model_config.lora:
      return lora.join_nested(self.reference, self.base_params())
    return self.reference

  def _aux(self, prox: Optional[list], ref: Optional[list]) -> Optional[list]:
    """Per micro-batch ``aux`` of a gradient step: {"prox": ..., "ref": ...} as present."""
    if prox is None and ref is None:
      return None
    n = len(prox if prox is not None else ref)
    return [{**({"prox": prox[j]} if prox is not None else {}), **({"ref": ref[j]} if ref is not None else {})}
            for j in range(n)]

  def base_params(self) -> dict:
    """The policy's parameters other than LoRA adapters (all of them without LoRA)."""
    return lora.split_nested(self.params)[1] if self.model_config.lora else self.params

  def _prox_impl(self, params, batch):
    return token_logprobs(self.model_config, params, batch.tokens, batch.positions, batch.segment_ids,
                          temperature=self.settings.temperature, top_k=self.settings.top_k,
                          top_p=self.settings.top_p, mesh=self.mesh,
                          vocab_chunk=self.settings.vocab_chunk,
                          forward=self.settings.forward.replace(remat="none"),
                          eos_banned_bt=batch.eos_banned, eos_ban_ids=self.settings.eos_ban_ids,
                          routes_btlk=batch.routes if self.settings.replay_routes else None)

  def warm_up(self, longest: int) -> int:
    """Compiles every micro-batch shape that sequences of up to ``longest`` tokens can be packed
    into (one per row bucket), for each update this learner runs, so no version compiles mid-run.
    Nothing is applied: parameters and optimizer state stay bit for bit. Returns the shapes."""
    cap = batching.bucket(min(longest, self.model_config.max_seq_len))
    shapes = [b for b in bucketing.ROW_BUCKETS if b <= min(self.updater.token_budget, cap)]
    skip = jax.device_put(np.bool_(False), self.updater.replicated)
    later = self.settings.needs_prox and self.minibatches > 1
    for width in shapes:
      seq = batching.make_sequence(np.zeros(width - 1, np.int32), np.zeros(1, np.int32),
                                   logprobs=np.zeros(1, np.float32), versions=np.zeros(1, np.int32),
                                   routes=self.placeholder_routes(width))
      mbs, normalizer = self.updater.place([seq])
      ref = [self._prox(self.reference_params(), b) for b in mbs] if self.settings.kl_coef else None
      _, health = self.updater.update(mbs, normalizer, loss="first", aux=self._aux(None, ref), proceed=skip)
      if later or (self.settings.kl_coef and self.minibatches > 1):
        prox = [self._prox(self.params, b) for b in mbs] if later else None
        _, health = self.updater.update(mbs, normalizer, loss="later", aux=self._aux(prox, ref),
                                        proceed=skip)
      if self.critic is not None:
        aux = [(values, returns) for _, returns, values in self.critic.estimate(mbs)]
        _, value_health = self.critic.updater.update(mbs, normalizer, loss="value", aux=aux,
                                                     proceed=skip)
        jax.block_until_ready(value_health)
      jax.block_until_ready(health)
    return len(shapes)

  def placeholder_routes(self, n: int) -> Optional[np.ndarray]:
    """Routes for ``n`` tokens that route each to experts 0..k-1 (a warm-up sequence's), when the
    run's batches carry recorded routes; else None."""
    if self.settings.route_shape is None:
      return None
    layers, k = self.settings.route_shape
    return np.broadcast_to(np.arange(k, dtype=batching.ROUTE_DTYPE), (n, layers, k)).copy()

  def programs(self, row_len: int) -> list:
    """``(name, jitted function, arguments)`` of every program a version runs, on full micro-batches
    of rows of ``row_len`` tokens: the gradient step of the version's first update (and of its later
    ones, with their prox log-probs, when the objective needs them and a version takes several
    updates), the prox pass that makes those, the gradient sum, the optimizer step, and the value
    model's programs in value mode. Arguments are shapes when the learner was built from shapes
    (``asyncrl_jax.tpu``): for compiling without running."""
    batch = self.updater.abstract_micro_batch(row_len)
    kl = bool(self.settings.kl_coef)
    later = (self.settings.needs_prox or kl) and self.minibatches > 1
    spec = jax.ShapeDtypeStruct(batch.tokens.shape, np.float32, sharding=batch.tokens.sharding)
    ref = {"ref": spec} if kl else {}
    aux = {"first": ref or None, "later": {**({"prox": spec} if self.settings.needs_prox else {}), **ref}}
    out = [p for p in self.updater.programs(batch, aux) if later or p[0] != "grad_step[later]"]
    if self.settings.needs_prox and self.minibatches > 1:
      out.insert(2, ("prox_pass", self._prox, (self.params, batch)))
    elif kl:  # (the same program as the prox pass, on the reference's weights)
      out.insert(2, ("reference_pass", self._prox, (self.reference_params(), batch)))
    return out + (self.critic.programs(batch) if self.critic is not None else [])

  def schedule_position(self) -> dict:
    """``optimizer_steps``: the policy's applied optimizer updates so far (read back);
    ``learning_rate``: the rate the latest of them ran at (the peak before any)."""
    steps = update_lib.optimizer_steps(self.opt_state)
    rate = self._schedule(max(steps - 1, 0)) if callable(self._schedule) else self._schedule
    return {"optimizer_steps": steps, "learning_rate": float(rate)}

  def check_version(self, version: int, what: str) -> None:
    if version != self.version:
      raise VersionMismatch(f"{what} is for policy version {version}, but the learner is at version "
                            f"{self.version}")

  def train(self, sequences: Sequence[batching.SequenceData], *, version: int) -> dict:
    """One policy version from the global batch for ``version``; returns metrics (host floats).

    Raises ``VersionMismatch`` if ``version`` is not the learner's. Nothing is read back from the
    device until the last update has been dispatched, so the host never stalls the pipeline.
    """
    self.check_version(version, "the training batch")
    t0 = time.perf_counter()
    chunks = np.array_split(np.arange(len(sequences)), min(self.minibatches, len(sequences)))
    placed = []
    for idx in chunks:
      chunk = [batching.with_staleness(sequences[i], version) for i in idx]
      if self.aggregation == "sequence_mean":
        chunk = batching.weight_sequences_equally(chunk)
      placed.append(self.updater.place(chunk))
    estimates = None
    if self.critic is not None:  # advantages from the value model before this version's updates
      estimates = [self.critic.estimate(mbs) for mbs, _ in placed]
      placed = [([b._replace(advantages=e[0]) for b, e in zip(mbs, est)], normalizer)
                for (mbs, normalizer), est in zip(placed, estimates)]
    # the first rl.value_pretrain_versions versions train the value model only
    trains_policy = self.critic is None or version >= self.critic.pretrain_versions
    # Prox log-probs for later minibatches, under the weights before this version's first update.
    needs_prox = self.settings.needs_prox and trains_policy
    prox = [[self._prox(self.params, b) for b in mbs] if needs_prox and i else None
            for i, (mbs, _) in enumerate(placed)]
    # rl.kl_coef: the reference policy's log-probs of every micro-batch
    ref = [[self._prox(self.reference_params(), b) for b in mbs] if self.settings.kl_coef and trains_policy
           else None for mbs, _ in placed]
    aux_of = [self._aux(p, r) for p, r in zip(prox, ref)]
    per_mb, health = [], []
    for i, ((mbs, normalizer), aux) in enumerate(zip(placed, aux_of) if trains_policy else ()):
      metrics, h = self.updater.update(mbs, normalizer, loss="later" if i else "first", aux=aux,
                                       proceed=health[-1]["applied"] if health else None)
      per_mb += metrics
      health.append(h)
    value = self._train_critic(placed, estimates, sequences) if estimates is not None else None
    per_mb, health, value = jax.device_get((per_mb, health, value))
    out = {}
    if trains_policy:
      counts = collections.Counter()
      for m in per_mb:  # every update's micro-batches: which policy tokens weighed 0, and where
        counts.update(selection.counts_of(m.pop("selection")))
      out = _combine(per_mb, len(placed))
      self._check_finite(out, health, version)
      out.update(selection.selection_metrics(counts),
                 grad_norm=float(np.mean([h["grad_norm"] for h in health])),
                 **self.schedule_position())
    if value is not None:
      out.update(self._value_metrics(value, version), policy_trained=float(trains_policy))
    self.version += 1
    out.update(learner_seconds=time.perf_counter() - t0,
               micro_batches=sum(len(m) for m, _ in placed), version=self.version)
    return out

  def _train_critic(self, placed: list, estimates: list, sequences) -> tuple:
    """The critic's updates on every micro-batch of the version (one normaliser: the batch's policy
    tokens); returns what ``_value_metrics`` reads, on device."""
    mbs = [b for m, _ in placed for b in m]
    flat = [e for est in estimates for e in est]
    tokens = np.float32(max(sum(float(np.sum(s.mask)) for s in sequences), 1.0))
    per_step, health = self.critic.train(mbs, flat, jax.device_put(tokens, self.updater.replicated))
    return per_step, health, self.critic.moments(mbs, flat)

  def _value_metrics(self, value: tuple, version: int) -> dict:
    per_step, health, moments = value
    out = critic_lib.host_value_metrics(per_step, health, moments)
    problem = critic_lib.check_finite(out, health, version)
    if problem:
      raise NonFiniteError(f"policy version {version}: non-finite {problem}. The run stops here; its "
                           "checkpoints are untouched, and the last one is the last good state "
                           "(lower rl.value_learning_rate)")
    return out

  def _check_finite(self, metrics: dict, health: list, version: int) -> None:
    """Raises ``NonFiniteError`` naming the version and the first non-finite figure: a loss metric,
    the gradients or the parameters (an optimizer step whose gradients or results were not finite
    was not applied)."""
    bad = [(f"{k} (update {i + 1} of {len(health)})", v) for i, h in enumerate(health)
           for k, v in (("gradients' norm", h["grad_norm"]), ("new parameters' norm", h["param_norm"]))
           if not np.isfinite(v)]
    bad += [(k, v) for k, v in metrics.items() if not np.isfinite(v)]
    if bad:
      what, value = bad[0]
      skipped = sum(not h["applied"] for h in health)
      raise NonFiniteError(f"policy version {version}: non-finite {what} = {value}; "
                           f"{skipped} of {len(health)} optimizer steps of this version were not "
                           "applied (a step's first non-finite figure stops the version's later "
                           "steps too). The run stops here; its checkpoints are untouched, and the "
                           "last one is the last good state (lower learner.learning_rate, or look "
                           "at the batch of this version)")

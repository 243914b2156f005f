"""The one update loop, shared by the supervised warm start and RL: pack -> pad -> grad -> accumulate
-> apply.

An ``Updater`` owns a model's trainable state on a mesh (params and optimizer state) and applies one
optimizer update per call of ``update``: the sequences are packed into fixed-shape micro-batches under
a token budget (``rl.batching``), padded so their rows divide over the mesh's batch axes, put on the
mesh, and each micro-batch's gradient (of a loss normalised by the whole update's policy-token count)
is summed before one optimizer step. What the loss is belongs to the caller: the learner's policy
objective or the warm start's negative log-likelihood.

Placement is explicit: every jitted step has in/out shardings (params and gradients on the model's
shardings, micro-batches split over ``data`` x ``fsdp``, scalars replicated), and params and optimizer
state are donated to the step that replaces them. Each jitted function traces at most once per
micro-batch shape the bucketing allows (``chex.assert_max_traces``), so a shape that escapes the
bucketing fails loudly instead of recompiling every step.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from asyncrl_jax import models
from asyncrl_jax.infra import bucketing
from asyncrl_jax.infra import sharding as sharding_lib
from asyncrl_jax.models import lora
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.rl import batching


def learning_rate_schedule(*, learning_rate: float, total_steps: int, warmup_steps: int = 0,
                           schedule: str = "cosine"):
  """The learning rate as a function of the optimizer's step count (``optax.Schedule``), or a float.

  ``schedule="cosine"``: linear warmup over ``warmup_steps``, then cosine decay to 10% of
  ``learning_rate`` over a run of ``total_steps`` *optimizer updates* (not policy versions: a version
  of ``learner.ppo_minibatches`` minibatches is that many updates): the first update after warmup
  runs at the peak, the last (step ``total_steps - 1``) at the floor; ``"constant"``:
  ``learning_rate``."""
  if schedule == "constant":
    return learning_rate
  if schedule != "cosine":
    raise ValueError(f"schedule={schedule!r} must be 'cosine' or 'constant'")
  if warmup_steps:
    return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps,
                                              max(total_steps - 1, warmup_steps + 1), learning_rate * 0.1)
  return optax.cosine_decay_schedule(learning_rate, max(total_steps - 1, 1), alpha=0.1)


def make_optimizer(*, learning_rate, total_steps: int, grad_clip: float, warmup_steps: int = 0,
                   schedule: str = "cosine", b1: float = 0.9, b2: float = 0.999,
                   weight_decay: float = 1e-4, adapters_only: bool = False) -> optax.GradientTransformation:
  """AdamW after global-norm clipping at ``grad_clip``, at ``learning_rate_schedule``'s rate over
  ``total_steps`` optimizer updates (``learning_rate`` may instead be a schedule already: it is used
  as it is). ``adapters_only`` (LoRA): only the adapter leaves are updated, clipped by their own norm
  and given optimizer state; every other leaf's update is zero and it holds no state, so the compiled
  step never needs the base weights' gradients."""
  if not grad_clip > 0:
    raise ValueError(f"grad_clip={grad_clip} must be > 0")
  lr = learning_rate if callable(learning_rate) else learning_rate_schedule(
      learning_rate=learning_rate, total_steps=total_steps, warmup_steps=warmup_steps, schedule=schedule)
  optimizer = optax.chain(optax.clip_by_global_norm(grad_clip),
                          optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay))
  if adapters_only:
    optimizer = optax.multi_transform({lora.TRAIN: optimizer, lora.FROZEN: optax.set_to_zero()},
                                      lora.trainable_labels)
  return optimizer


def optimizer_steps(opt_state) -> int:
  """How many updates an optimizer from ``make_optimizer`` has applied (its Adam step count; an
  update that was not applied, e.g. a non-finite one, does not count). Reads one scalar back."""
  counts = [s.count for s in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]
  if not counts:
    raise ValueError("the optimizer state holds no Adam step count (not from make_optimizer?)")
  return int(np.asarray(counts[0].addressable_shards[0].data))  # (replicated: any process's copy)


def is_abstract(tree) -> bool:
  """Whether ``tree``'s leaves are all ``jax.ShapeDtypeStruct`` (shapes to compile for, no arrays)."""
  leaves = jax.tree.leaves(tree)
  return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def with_shardings(tree, shardings):
  """``jax.ShapeDtypeStruct`` leaves of ``tree``'s shapes and dtypes, placed on ``shardings``."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def opt_state_shardings(optimizer, params, param_shardings, replicated):
  """Shardings of ``optimizer``'s state for ``params`` (arrays or shapes): every leaf of a copy of the
  parameter tree inside it (AdamW's mu and nu, whole or, with LoRA, the adapters' part only) on its
  parameter's sharding, everything else (step counts) ``replicated``. A state leaf is a parameter's
  copy when its path ends with that parameter's path and its shape is the parameter's."""
  state = jax.eval_shape(optimizer.init, params)
  names = lambda path: tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
  by_path = {names(path): (leaf.shape, sharding) for (path, leaf), sharding in zip(
      jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(param_shardings))}
  depths = sorted({len(k) for k in by_path}, reverse=True)

  def pick(path, leaf):
    keys = names(path)
    for depth in depths:
      hit = by_path.get(keys[-depth:]) if len(keys) >= depth else None
      if hit is not None and tuple(hit[0]) == tuple(leaf.shape):
        return hit[1]
    return replicated

  return jax.tree_util.tree_map_with_path(pick, state)


def micro_batch_shapes(token_budget: int, max_seq_len: int) -> int:
  """How many micro-batch shapes packing can produce: one per row bucket that fits both the token
  budget and the model's longest sequence (the rows per micro-batch follow from the row length)."""
  longest = bucketing.bucket(max_seq_len, bucketing.ROW_BUCKETS)
  return max(1, sum(1 for b in bucketing.ROW_BUCKETS if b <= min(token_budget, longest)))


class Updater:
  """Params and optimizer state on ``mesh``, updated by ``update(micro_batches, normalizer, ...)``.

  Args:
    model_config: the model (for its parameter shardings).
    params: initial parameters, any placement; a private copy is put on the mesh.
    mesh: the training mesh (axes ``data``, ``fsdp``, ``tensor``).
    optimizer: from ``make_optimizer``.
    losses: name -> ``loss_fn(params, batch, aux, normalizer) -> (loss, metrics)``, ``aux`` an optional
      per-micro-batch array (e.g. the prox log-probs) or None; ``update(..., loss=name)`` picks one.
    token_budget: tokens per micro-batch.
    opt_state: restored optimizer state (on the mesh), or None for a fresh one.
    param_shardings: the params' shardings when they are not the model's own (a value model's trunk
      and head); None: ``models.param_shardings``.
  """

  def __init__(self, model_config: ModelConfig, params, mesh: Mesh, optimizer, losses: dict, *,
               token_budget: int, opt_state=None, param_shardings=None, adapters_only: bool = False,
               route_shape: Optional[tuple] = None):
    self.model_config, self.mesh, self.optimizer = model_config, mesh, optimizer
    self.route_shape = route_shape  # (L_moe, k) when micro-batches carry recorded routes
    self.token_budget = token_budget
    self.param_shardings = (models.param_shardings(model_config, mesh) if param_shardings is None
                            else param_shardings)
    # LoRA: gradients are taken with respect to the adapters alone (the base is a constant of the
    # loss), so no program forms, sums or holds a base weight's gradient; the optimizer and its state
    # see the adapters alone
    self.adapters_only = bool(adapters_only and model_config.lora)
    self.grad_shardings = self._trained(self.param_shardings)
    self.replicated = sharding_lib.replicated(mesh)
    self.batch_sharding = sharding_lib.batch_sharding(mesh, 2)
    self.rows_multiple = sharding_lib.batch_ways(mesh)
    self.max_traces = micro_batch_shapes(token_budget, model_config.max_seq_len)
    # The optimizer's per-parameter state (AdamW's moments) on the parameters' shardings, the rest
    # (step counts) replicated: left to itself, jit would replicate moments it creates from zeros.
    self.opt_shardings = opt_state_shardings(optimizer, self._trained(params), self.grad_shardings,
                                             self.replicated)
    self.abstract = is_abstract(params)
    init = lambda p: optimizer.init(self._trained(p))
    if self.abstract:  # shapes only, for compiling (``asyncrl_jax.tpu``): nothing is allocated
      self.params = with_shardings(params, self.param_shardings)
      self.opt_state = with_shardings(jax.eval_shape(init, params), self.opt_shardings)
    else:
      # A private copy: updates donate these buffers, and the caller may still hold the ones it passed.
      self.params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.param_shardings)(
          jax.device_put(params, self.param_shardings))
      self.opt_state = (jax.jit(init, out_shardings=self.opt_shardings)(self.params)
                        if opt_state is None else jax.device_put(opt_state, self.opt_shardings))
    self._grads = {name: self._jit_grad(fn, name) for name, fn in losses.items()}
    self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=(0,),
                        in_shardings=(self.grad_shardings, self.grad_shardings),
                        out_shardings=self.grad_shardings)
    self._proceed = (None if self.abstract else  # (placed once, not per step)
                     jax.device_put(np.bool_(True), self.replicated))
    self._apply = jax.jit(self._apply_impl, donate_argnums=(0, 1),
                          in_shardings=(self.param_shardings, self.opt_shardings, self.grad_shardings,
                                        self.replicated),
                          out_shardings=(self.param_shardings, self.opt_shardings, self.replicated))

  def _trained(self, tree):
    """The part of a parameter-shaped ``tree`` that has gradients: all of it, or the adapters."""
    return lora.split_nested(tree)[0] if self.adapters_only else tree

  def _jit_grad(self, loss_fn: Callable, name: str):
    def grad(params, batch, aux, normalizer):
      if self.adapters_only:
        adapters, base = lora.split_nested(params)
        f = lambda a: loss_fn(lora.join_nested(a, base), batch, aux, normalizer)
        (loss, metrics), grads = jax.value_and_grad(f, has_aux=True)(adapters)
      else:
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, aux, normalizer)
      return loss, metrics, grads
    return jax.jit(bucketing.bounded_traces(grad, f"grad_{name}", self.max_traces),
                   in_shardings=(self.param_shardings, self.batch_sharding, self.batch_sharding,
                                 self.replicated),
                   out_shardings=(self.replicated, self.replicated, self.grad_shardings))

  def _apply_impl(self, params, opt_state, grads, proceed):
    """The optimizer step, applied only if ``proceed`` and the gradients and the new parameters are
    finite (else params and optimizer state stay as they were); returns them and the step's health:
    gradient norm, new parameters' norm, and whether it was applied."""
    trained = self._trained(params)
    updates, new_opt_state = self.optimizer.update(grads, opt_state, trained)
    new_params = optax.apply_updates(trained, updates)
    if self.adapters_only:
      new_params = lora.join_nested(new_params, lora.split_nested(params)[1])
    grad_norm, param_norm = optax.tree.norm(grads), optax.tree.norm(new_params)
    ok = proceed & jnp.isfinite(grad_norm) & jnp.isfinite(param_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    return (keep(new_params, params), keep(new_opt_state, opt_state),
            {"grad_norm": grad_norm, "param_norm": param_norm, "applied": ok})

  def jit_forward(self, fn, name: str):
    """``fn(params, batch) -> [R, L]`` (or a tuple of them) jitted with this updater's shardings and
    trace bound (e.g. the learner's prox pass)."""
    def forward(params, batch):
      return fn(params, batch)
    return jax.jit(bucketing.bounded_traces(forward, name, self.max_traces),
                   in_shardings=(self.param_shardings, self.batch_sharding),
                   out_shardings=self.batch_sharding)

  def abstract_micro_batch(self, row_len: int) -> batching.TokenBatch:
    """The shapes (``jax.ShapeDtypeStruct`` on the mesh) of a full micro-batch of rows of
    ``row_len`` tokens, as ``place`` lays it out."""
    rows = max(1, self.token_budget // row_len)
    rows = -(-rows // self.rows_multiple) * self.rows_multiple
    host = batching.layout_rows([], [[]], 1, row_len)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)
    routes = (None if self.route_shape is None else
              spec((rows, row_len, *self.route_shape), batching.ROUTE_DTYPE))
    return batching.TokenBatch(*(spec((rows, row_len), x.dtype) for x in host[:-1]), routes=routes)

  def programs(self, batch, aux: Optional[dict] = None) -> list:
    """``(name, jitted function, arguments)`` of every program one ``update`` runs on micro-batches
    shaped like ``batch`` (e.g. ``abstract_micro_batch``): each loss's gradient step (``aux``: loss
    name -> its per-micro-batch ``aux``), the gradient sum, and the optimizer step. The arguments are
    this updater's own (shapes, when it is ``abstract``): for compiling without running."""
    aux = aux or {}
    normalizer = jax.ShapeDtypeStruct((), jnp.float32, sharding=self.replicated)
    grads = with_shardings(self._trained(self.params), self.grad_shardings)
    proceed = jax.ShapeDtypeStruct((), jnp.bool_, sharding=self.replicated)
    out = [(f"grad_step[{name}]", fn, (self.params, batch, aux.get(name), normalizer))
           for name, fn in self._grads.items()]
    return out + [("accumulate", self._add, (grads, grads)),
                  ("apply", self._apply, (self.params, self.opt_state, grads, proceed))]

  def place(self, sequences: Sequence[batching.SequenceData]) -> tuple[list, jax.Array]:
    """Packs ``sequences`` (the whole global batch, the same in every process) into micro-batches on
    the mesh; returns them and the normaliser (their policy-token count, at least 1) on the mesh.

    The packing plan depends only on the sequences, so it is the same in every process; each process
    then lays out and puts on device only the rows its devices hold (all of them with one process).
    """
    sequences = self._routed(sequences)
    plan = batching.plan_micro_batches([len(s.tokens) for s in sequences], self.token_budget)
    rows = -(-plan.rows // self.rows_multiple) * self.rows_multiple  # divides over data x fsdp x expert
    normalizer = np.float32(max(sum(float(np.sum(s.mask)) for s in sequences), 1.0))
    device = [self._put_rows(sequences, mb, rows, plan.row_len) for mb in plan.micro_batches]
    return device, jax.device_put(normalizer, self.replicated)

  def _routed(self, sequences):
    """``sequences`` as this updater's micro-batches hold them: each with routes of ``route_shape``
    per token when it has one (a sequence without is refused: every micro-batch must have the same
    structure, and a pass that silently did not replay would train another objective), without
    routes otherwise."""
    if self.route_shape is None:
      return [s if s.routes is None else s._replace(routes=None) for s in sequences]
    for i, s in enumerate(sequences):
      if s.routes is None or tuple(np.shape(s.routes)[1:]) != tuple(self.route_shape):
        got = "none" if s.routes is None else list(np.shape(s.routes))
        raise batching.PackingError(
            f"sequence {i} of a minibatch has no routes of [tokens, {self.route_shape[0]} MoE layers, "
            f"{self.route_shape[1]} experts] (got {got}); the learner replays the decode servers' "
            "routes (rollout.record_routes), so every trajectory must carry them")
    return list(sequences)

  def _put_rows(self, sequences, mb_rows: list, rows: int, row_len: int):
    if jax.process_count() == 1:
      return jax.device_put(batching.layout_rows(sequences, mb_rows, rows, row_len), self.batch_sharding)
    shape = (rows, row_len)
    local = sorted({r for idx in self.batch_sharding.addressable_devices_indices_map(shape).values()
                    for r in range(rows)[idx[0]]})
    if local != list(range(local[0], local[-1] + 1)):
      raise ValueError(f"process {jax.process_index()} holds rows {local} of a micro-batch, not one "
                       "contiguous block; order the mesh's devices by process")
    mine = [mb_rows[r] if r < len(mb_rows) else [] for r in local]
    host = batching.layout_rows(sequences, mine, len(local), row_len)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x, shape + x.shape[2:]),
        host)

  def update(self, micro_batches: Sequence, normalizer, *, loss: str,
             aux: Optional[Sequence] = None, proceed=None) -> tuple[list, dict]:
    """One optimizer update from the summed gradients of ``micro_batches`` (from ``place``).

    Returns the per-micro-batch metrics (with ``loss``) and the step's health (``grad_norm``,
    ``param_norm``, ``applied``: False when a gradient or a new parameter was not finite, in which
    case nothing changed), on device: nothing is read back, so the host never stalls the pipeline.
    ``proceed``: a previous step's ``applied`` (on device): if it is False this step is not applied
    either, so a version stops changing the weights at its first non-finite step.
    """
    grad_fn = self._grads[loss]
    grads, per_mb = None, []
    for i, b in enumerate(micro_batches):
      value, metrics, g = grad_fn(self.params, b, None if aux is None else aux[i], normalizer)
      grads = g if grads is None else self._add(grads, g)
      per_mb.append(dict(metrics, loss=value))
    self.params, self.opt_state, health = self._apply(
        self.params, self.opt_state, grads, self._proceed if proceed is None else proceed)
    return per_mb, health

"""A value model for single-rollout advantages (SAO): the policy's trunk with a scalar head.

``V(s_t)`` for token ``t`` is the value of the state the token was chosen in: the trunk's final hidden
state at ``t - 1`` (after the final norm) times a ``[D]`` head, plus a bias. Values are aligned like the
policy's log-probs (``rl.logprobs``): position ``t`` holds ``V(s_t)``, and positions without context in
their segment (a segment's first token, padding) hold 0, so they must carry mask 0.

Parameters: ``{"trunk": <policy params>, "head": {"w": [D], "b": []}}``. ``init_value_params`` copies
the policy's weights as the trunk (the version the run starts from) and zeroes the head, so every value
is 0 until the value model is trained. The policy's output projection stays in the trunk unused (one
``[D, V]`` matrix): the trunk keeps the policy's layout, so the same shardings and the same forward
apply. ``value_optimizer`` can freeze the trunk's attention parameters (only the MLPs, norms,
embeddings and head train), which SAO offers to keep the value model's features close to the
policy's.

The value model is the learner's alone: it is trained and checkpointed with the run and never sent to
decode servers.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from asyncrl_jax.models import api
from asyncrl_jax.models.api import aligned  # (values line up with log-probs, one shared shift)
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.models.forward import Forward

ATTENTION = "attn"  # the name of every layer's attention block in the policy's parameters


def init_value_params(policy_params) -> dict:
  """The value model's parameters: a copy of ``policy_params`` as the trunk, a zero head."""
  hidden = policy_params["final_norm"]["scale"].shape[0]
  dtype = policy_params["final_norm"]["scale"].dtype
  return {"trunk": jax.tree.map(jnp.copy, policy_params),
          "head": {"w": jnp.zeros((hidden,), dtype), "b": jnp.zeros((), dtype)}}


def token_values(config: ModelConfig, value_params, tokens_bt, positions_bt, segment_ids_bt, *,
                 mesh: Optional[Mesh] = None, forward: Forward = Forward()):
  """Traceable: ``V(s_t)`` ``[B, T]`` float32, aligned (position ``t``: the state before token ``t``)."""
  hidden, _ = api.apply_hidden(config, value_params["trunk"], tokens_bt, positions_bt, segment_ids_bt,
                               mesh, forward=forward)
  head = value_params["head"]
  v = jnp.einsum("BTD,D->BT", hidden[:, :-1].astype(jnp.float32), head["w"].astype(jnp.float32))
  return aligned(v + head["b"].astype(jnp.float32), None, segment_ids_bt, with_entropy=False)


def frozen_attention_labels(value_params) -> dict:
  """``"frozen"`` for the trunk's attention parameters, ``"trained"`` for every other leaf."""
  def label(path, _):
    return "frozen" if path[0].key == "trunk" and any(
        getattr(k, "key", None) == ATTENTION for k in path) else "trained"
  return jax.tree_util.tree_map_with_path(label, value_params)


def value_optimizer(base: optax.GradientTransformation, value_params, *,
                    freeze_attention: bool) -> optax.GradientTransformation:
  """``base`` for the value model; with ``freeze_attention`` the trunk's attention parameters get no
  update at all (not even weight decay)."""
  if not freeze_attention:
    return base
  return optax.multi_transform({"trained": base, "frozen": optax.set_to_zero()},
                               frozen_attention_labels(value_params))


def explained_variance(values, returns, mask) -> jax.Array:
  """``1 - Var(returns - values) / Var(returns)`` over the tokens with ``mask`` (the share of the
  returns' variance the value model accounts for; 0 for a constant prediction at the mean, negative
  when worse than that). 0 when the returns do not vary."""
  mask = jnp.asarray(mask, jnp.float32)
  n = jnp.maximum(jnp.sum(mask), 1.0)

  def var(x):
    mean = jnp.sum(mask * x) / n
    return jnp.sum(mask * jnp.square(x - mean)) / n

  returns = jnp.asarray(returns, jnp.float32)
  total = var(returns)
  return jnp.where(total > 0, 1.0 - var(returns - jnp.asarray(values, jnp.float32)) /
                   jnp.where(total > 0, total, 1.0), 0.0)

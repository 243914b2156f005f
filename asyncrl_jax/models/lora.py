"""LoRA adapters on the policy (``model.lora``): which parameters are adapters, adding fresh ones to
loaded base weights, and folding them into the base.

The adapters live in the model's own parameter tree, beside the projection they adapt: projection
``q`` of a layer's attention has ``q_lora_a`` ``[d, r]`` and ``q_lora_b`` ``[r, N, H]``
(``transformer._adapter``), and the model adds ``(alpha / r) (x A) B`` to ``x W``. ``B`` starts at
zero, so a model with new adapters computes exactly what its base does. The learner trains only the
adapters (``trainable_labels``: the rest of the tree is frozen by the optimizer, which keeps no state
for it); ``merge`` folds them into the base weights, for the Hugging Face export.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh

from asyncrl_jax.models.config import ModelConfig

SUFFIXES = ("_lora_a", "_lora_b")
TRAIN, FROZEN = "train", "frozen"


def is_adapter(path: tuple) -> bool:
  """Whether the parameter at ``path`` (a tuple of keys) is a LoRA adapter's."""
  return str(path[-1]).endswith(SUFFIXES)


def trainable_labels(params) -> Any:
  """``TRAIN`` for every adapter leaf of ``params``, ``FROZEN`` for the rest (``optax.multi_transform``
  labels)."""
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict({k: TRAIN if is_adapter(k) else FROZEN for k in flat})


def split(params) -> tuple[dict, dict]:
  """``(adapters, base)``: the two parts of ``params`` as flat dicts keyed by path."""
  flat = traverse_util.flatten_dict(params)
  return ({k: v for k, v in flat.items() if is_adapter(k)},
          {k: v for k, v in flat.items() if not is_adapter(k)})


def split_nested(params) -> tuple[dict, dict]:
  """``(adapters, base)`` as two nested trees shaped like ``params`` (traceable)."""
  adapters, base = split(params)
  return traverse_util.unflatten_dict(adapters), traverse_util.unflatten_dict(base)


def join_nested(adapters: dict, base: dict) -> dict:
  """``split_nested``'s inverse."""
  return traverse_util.unflatten_dict(traverse_util.flatten_dict(base) | traverse_util.flatten_dict(adapters))


def count(params) -> int:
  """How many adapter parameters ``params`` holds."""
  return sum(int(v.size) for v in split(params)[0].values())


def add_adapters(config: ModelConfig, base, rng: jax.Array, mesh: Optional[Mesh] = None) -> dict:
  """``base`` (parameters of ``config`` without adapters, e.g. loaded from Hugging Face) with fresh
  adapters of ``config``'s rank on its targets, sharded like a fresh model's. Only the adapters are
  initialised (the program returns nothing else, so the base's initialisation is never computed)."""
  if not config.lora:
    return base
  from asyncrl_jax.models import api  # pylint: disable=import-outside-toplevel  (api imports this)
  unexpected = [k for k in traverse_util.flatten_dict(base) if is_adapter(k)]
  if unexpected:
    raise ValueError(f"the base parameters already hold adapters ({'/'.join(map(str, unexpected[0]))})")
  init = api.init_fn(config, mesh)
  shardings = api.param_shardings(config, mesh) if mesh is not None else None
  only = lambda tree: {k: v for k, v in traverse_util.flatten_dict(tree).items() if is_adapter(k)}
  out = None if shardings is None else only(shardings)
  adapters = jax.jit(lambda r: only(init(r)), out_shardings=out)(rng)
  flat = {**traverse_util.flatten_dict(base), **adapters}
  want = set(traverse_util.flatten_dict(api.abstract_params(config)))
  if set(flat) != want:
    missing, extra = sorted(want - set(flat)), sorted(set(flat) - want)
    raise ValueError(f"the base parameters do not fit model config {config}: missing {missing[:3]}, "
                     f"unexpected {extra[:3]}")
  return traverse_util.unflatten_dict(flat)


def base_model(config: ModelConfig, params) -> tuple[ModelConfig, dict]:
  """``(config without LoRA, params without adapters)``: the frozen base a LoRA model trains on."""
  return config.replace(lora_rank=0), traverse_util.unflatten_dict(split(params)[1])


def merge(config: ModelConfig, params) -> tuple[ModelConfig, dict]:
  """``(config without LoRA, params)`` with every adapter folded into its projection:
  ``W + (alpha / r) A B``, in the projection's dtype (float32 arithmetic)."""
  if not config.lora:
    return config, params
  adapters, base = split(params)
  out = dict(base)
  for key, a in adapters.items():
    if not str(key[-1]).endswith("_lora_a"):
      continue
    name = str(key[-1])[:-len("_lora_a")]
    b = adapters[key[:-1] + (f"{name}_lora_b",)]
    w_key = key[:-1] + (name,)
    w = base[w_key]
    delta = jnp.tensordot(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), axes=1)
    out[w_key] = (jnp.asarray(w, jnp.float32) + config.lora_scale * delta.reshape(w.shape)).astype(w.dtype)
  return config.replace(lora_rank=0), traverse_util.unflatten_dict(out)


def fingerprint(base) -> dict:
  """A name for frozen base weights (a tree without adapters) that does not depend on how they are
  sharded: per leaf (keyed by its ``/``-joined path) its shape, dtype and three float32 sums over
  its elements x_i: sum x_i, sum x_i^2 and sum x_i cos(0.618 (i mod 4096)). Other weights, even the same ones
  permuted, give other sums; the same weights on another mesh give the same sums up to the order of
  the additions (``same_base`` allows for that)."""
  flat = {"/".join(map(str, k)): v for k, v in traverse_util.flatten_dict(base).items()}

  def sums(x):
    x = jnp.ravel(x).astype(jnp.float32)
    wave = jnp.cos((jnp.arange(x.size, dtype=jnp.int32) % 4096).astype(jnp.float32) * 0.618)
    return jnp.stack([jnp.sum(x), jnp.sum(x * x), jnp.sum(x * wave)])

  values = jax.device_get(jax.jit(lambda tree: {k: sums(v) for k, v in tree.items()})(flat))
  return {k: dict(shape=list(flat[k].shape), dtype=str(flat[k].dtype), sums=[float(s) for s in values[k]])
          for k in sorted(flat)}


def base_mismatch(want: dict, have: dict, rtol: float = 1e-4) -> str:
  """Why fingerprint ``have`` is not of the same base weights as ``want`` ("" when it is). Each sum
  may differ by ``rtol`` of its largest possible size (sqrt(n sum x^2), or sum x^2 itself)."""
  if set(want) != set(have):
    diff = sorted(set(want) ^ set(have))
    return f"other parameters ({len(diff)} differ, e.g. {diff[0]})"
  for k in sorted(want):
    a, b = want[k], have[k]
    if a["shape"] != b["shape"] or a["dtype"] != b["dtype"]:
      return f"{k} is {b['dtype']}{b['shape']}, not {a['dtype']}{a['shape']}"
    n = max(1, int(np.prod(a["shape"])))
    scale = [np.sqrt(n * max(a["sums"][1], 0.0)), max(a["sums"][1], 0.0),
             np.sqrt(n * max(a["sums"][1], 0.0))]
    for name, x, y, s in zip(("sum", "sum of squares", "weighted sum"), a["sums"], b["sums"], scale):
      if abs(x - y) > rtol * s + 1e-30:
        return f"{k}: its {name} is {y:.6g}, not {x:.6g}"
  return ""

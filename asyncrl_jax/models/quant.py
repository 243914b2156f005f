"""int8 weights for decode servers (``rollout.weight_dtype="int8"``).

Each projection kernel (``q``, ``k``, ``v``, ``o``, ``gate``, ``up``, ``down`` and an untied
``lm_head``, and a mixture of experts' kernels per expert) is stored as symmetric int8 per output
channel: ``W ~ int8 * scale`` with ``scale`` (one
bfloat16 per output channel) = max |W| over the kernel's input axes / 127. The embedding table, norms,
biases and LoRA adapters keep their serving dtype (the table is gathered a row per token; the rest are
small). A decode step dequantizes each kernel in its program (``dequantize``, an element-wise product
the TPU compiler can fuse into the matrix product that reads it), so what the step reads from HBM is
the int8 kernels.

The quantized weights are ``{"weights": params with int8 kernels, "scales": {path: scale}}``, a
pytree that the engine's programs take in place of the parameters (``models.apply_decode``
recognises it). The behaviour policy a server records is the dequantized model's: the learner's
correction sees the policy that sampled.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec

WEIGHT_DTYPES = ("", "int8")  # "": the serving dtypes (``models.serving_dtypes``)
SCALE_DTYPE = jnp.bfloat16
# kernel name -> how many leading axes are its input (contracted) axes
INPUT_AXES = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1, "lm_head": 1}
# a mixture of experts' kernels [E, in, out]: quantized per expert and output channel (the input axis
# 1 reduced, its scale kept as [E, 1, out] so that it broadcasts); the router stays as served
EXPERT_KERNELS = ("experts_gate", "experts_up", "experts_down")


def check_weight_dtype(weight_dtype: str) -> str:
  if weight_dtype not in WEIGHT_DTYPES:
    raise ValueError(f"rollout.weight_dtype={weight_dtype!r}: must be one of {WEIGHT_DTYPES} "
                     "('': the model's serving dtypes)")
  return weight_dtype


def _quantized(path: tuple) -> bool:
  return str(path[-1]) in INPUT_AXES or str(path[-1]) in EXPERT_KERNELS


def _key(path: tuple) -> str:
  return "/".join(map(str, path))


def is_quantized(params: Any) -> bool:
  """Whether ``params`` is ``quantize``'s output rather than plain parameters."""
  return isinstance(params, dict) and set(params) == {"weights", "scales"}


def quantize_kernel(w: jax.Array, input_axes: int) -> tuple[jax.Array, jax.Array]:
  """``(int8 kernel, scale)``: symmetric per output channel (the axes after the first
  ``input_axes``), ``scale`` in bfloat16; the int8 values are those of ``w`` divided by the rounded
  scale, so that ``int8 * scale`` is what the server computes with."""
  w32 = jnp.asarray(w, jnp.float32)
  amax = jnp.max(jnp.abs(w32), axis=tuple(range(input_axes)))
  scale = jnp.where(amax > 0, amax / 127.0, 1.0).astype(SCALE_DTYPE)
  q = jnp.clip(jnp.round(w32 / scale.astype(jnp.float32)), -127, 127).astype(jnp.int8)
  return q, scale


def quantize_experts(w_eio: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``quantize_kernel`` for a mixture of experts' kernel ``[E, in, out]``: per expert and output
  channel, the scale ``[E, 1, out]``."""
  w32 = jnp.asarray(w_eio, jnp.float32)
  amax = jnp.max(jnp.abs(w32), axis=1, keepdims=True)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0).astype(SCALE_DTYPE)
  q = jnp.clip(jnp.round(w32 / scale.astype(jnp.float32)), -127, 127).astype(jnp.int8)
  return q, scale


def quantize(params: Any) -> dict:
  """Plain parameters -> ``{"weights", "scales"}`` (traceable: jit it with ``shardings``' result as
  its out_shardings to keep every array where its original lives)."""
  flat = traverse_util.flatten_dict(params)
  weights, scales = {}, {}
  for path, w in flat.items():
    if str(path[-1]) in EXPERT_KERNELS:
      weights[path], scales[_key(path)] = quantize_experts(w)
    elif _quantized(path):
      weights[path], scales[_key(path)] = quantize_kernel(w, INPUT_AXES[str(path[-1])])
    else:
      weights[path] = w
  return {"weights": traverse_util.unflatten_dict(weights), "scales": scales}


def dequantize(quantized: dict, dtype: Any) -> Any:
  """``quantize``'s output -> parameters whose kernels are ``int8 * scale`` in ``dtype`` (the
  others as they are)."""
  scales = quantized["scales"]
  flat = traverse_util.flatten_dict(quantized["weights"])
  out = {}
  for path, w in flat.items():
    s = scales.get(_key(path))
    out[path] = w if s is None else w.astype(dtype) * s.astype(dtype)
  return traverse_util.unflatten_dict(out)


def shardings(param_shardings: Any, abstract: Any) -> dict:
  """The shardings of ``quantize(params)`` for params sharded as ``param_shardings`` (with shapes
  ``abstract``): each int8 kernel where its kernel is, each scale as the kernel's output axes."""
  flat_s = traverse_util.flatten_dict(param_shardings)
  flat_a = traverse_util.flatten_dict(abstract)
  scales = {}
  for path, s in flat_s.items():
    if not _quantized(path):
      continue
    spec = tuple(s.spec) + (None,) * (len(flat_a[path].shape) - len(tuple(s.spec)))
    if str(path[-1]) in EXPERT_KERNELS:
      scales[_key(path)] = NamedSharding(s.mesh, PartitionSpec(spec[0], None, spec[2]))
      continue
    n_in = INPUT_AXES[str(path[-1])]
    scales[_key(path)] = NamedSharding(s.mesh, PartitionSpec(*spec[n_in:]))
  return {"weights": param_shardings, "scales": scales}


def nbytes(tree: Any) -> int:
  return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def max_error(params: Any, quantized: dict, dtype: Optional[Any] = None) -> float:
  """The largest |W - dequantized W| over the kernels, relative to each channel's scale (at most
  0.5 when the int8 values are rounded, as they are)."""
  deq = traverse_util.flatten_dict(dequantize(quantized, dtype or jnp.float32))
  worst = 0.0
  for path, w in traverse_util.flatten_dict(params).items():
    s = quantized["scales"].get(_key(path))
    if s is None:
      continue
    err = jnp.abs(jnp.asarray(w, jnp.float32) - jnp.asarray(deq[path], jnp.float32)) / s.astype(jnp.float32)
    worst = max(worst, float(jnp.max(err)))
  return worst

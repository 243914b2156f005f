"""Building blocks shared by the decoder's modules (``transformer``, ``moe``): parameters created with
their logical axes, LoRA adapter terms, RMSNorm."""

from __future__ import annotations

from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from asyncrl_jax.models.config import ModelConfig


def dtype_of(name: str):
  return jnp.dtype(name)


def param(module: nn.Module, name: str, init, shape: Sequence[int], axes: Sequence[Optional[str]],
          cfg: ModelConfig):
  return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape),
                      dtype_of(cfg.param_dtype))


def adapter(module: nn.Module, name: str, x, in_shape: Sequence[int], in_axes: Sequence[Optional[str]],
            out_shape: Sequence[int], out_axes: Sequence[Optional[str]], cfg: ModelConfig):
  """The LoRA term of projection ``name`` for its input ``x`` ``[B, T, *in_shape]``:
  ``(alpha / r) (x A) B`` with ``A`` ``[*in_shape, r]`` (``NAME_lora_a``, normal with variance 1 /
  fan-in) and ``B`` ``[r, *out_shape]`` (``NAME_lora_b``, zeros: a new adapter changes nothing); None
  when the projection has no adapter. Computed unmerged: two thin matmuls beside the frozen one, so
  the gradient never forms a full-size weight. The rank axis is replicated; the others shard like
  the projection's."""
  if not cfg.lora or name not in cfg.lora_targets:
    return None
  r, fan_in = cfg.lora_rank, int(np.prod(in_shape))
  init_a = lambda key, shape, dtype: jax.random.normal(key, shape, dtype) / np.sqrt(fan_in)
  a = param(module, f"{name}_lora_a", init_a, (*in_shape, r), (*in_axes, None), cfg)
  b = param(module, f"{name}_lora_b", nn.initializers.zeros, (r, *out_shape), (None, *out_axes), cfg)
  ins, outs = "IJ"[:len(in_shape)], "OP"[:len(out_shape)]
  low = jnp.einsum(f"BT{ins},{ins}R->BTR", x, a.astype(x.dtype))
  return jnp.einsum(f"BTR,R{outs}->BT{outs}", low, b.astype(x.dtype)) * jnp.asarray(cfg.lora_scale, x.dtype)


def plus(y, term):
  return y if term is None else y + term


def constrain(x, axes, mesh):
  if mesh is None:
    return x
  return nn.with_logical_constraint(x, axes, mesh=mesh)


class RMSNorm(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    scale = param(self, "scale", nn.initializers.ones, (x.shape[-1],), ("norm",), self.cfg)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.cfg.rms_norm_eps)
    return (scale.astype(jnp.float32) * x32).astype(dtype_of(self.cfg.dtype))

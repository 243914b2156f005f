"""Rotary position embedding: the frequencies, scaled as the hub's checkpoints say, and their use.

The inverse frequencies and the attention factor are computed once per ``ModelConfig``, in numpy
(``frequencies``), and enter the jitted programs as constants: no step recomputes them.

* ``default``: ``inv_freq[i] = theta ** (-2i / H)``;
* ``llama3`` (Llama 3.1 / 3.2 / 3.3): frequencies whose wavelength is above
  ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those below
  ``.../ high_freq_factor`` kept, the ones between interpolated smoothly;
* ``yarn`` (Qwen3 past 32k, DeepSeek): NTK-by-parts, a linear ramp over the dimensions between the
  correction range of ``beta_fast`` and ``beta_slow`` rotations mixes interpolated (``/ factor``) and
  original frequencies; cos and sin are multiplied by the attention factor ``0.1 ln(factor) + 1``
  (or the configured one), which scales the attention logits by its square.

The formulas are the ones ``transformers`` applies (``modeling_rope_utils``); the tests compare
logits with it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl_jax.models.config import ModelConfig, RopeScaling


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
  old = s.original_max_position_embeddings
  low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
  smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: RopeScaling) -> tuple[np.ndarray, float]:
  if s.attention_factor:
    attention_factor = s.attention_factor
  elif s.mscale and s.mscale_all_dim:
    attention_factor = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
  else:
    attention_factor = _yarn_mscale(s.factor)

  def correction_dim(rotations):
    return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
        2 * math.log(theta))

  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # no zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp
  pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  inv_freq = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
  return inv_freq, float(attention_factor)


@functools.lru_cache(maxsize=None)
def _frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[np.ndarray, float]:
  inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
  if scaling.rope_type == "llama3":
    return _llama3(inv_freq, scaling).astype(np.float32), 1.0
  if scaling.rope_type == "yarn":
    inv_freq, factor = _yarn(head_dim, theta, scaling)
    return inv_freq.astype(np.float32), factor
  return inv_freq.astype(np.float32), 1.0


def frequencies(config: ModelConfig) -> tuple[np.ndarray, float]:
  """``(inv_freq [H / 2] float32, attention_factor)`` of ``config``'s RoPE (cached per config)."""
  inv_freq, factor = _frequencies(config.head_dim, float(config.rope_theta), config.rope_scaling)
  inv_freq.flags.writeable = False
  return inv_freq, factor


def apply(x_btnh: jax.Array, positions_bt: jax.Array, inv_freq: np.ndarray,
          attention_factor: float = 1.0) -> jax.Array:
  """Rotary embedding, half-split convention (as in Hugging Face Qwen / Llama), of ``x`` ``[B, T,
  N, H]`` at ``positions`` ``[B, T]``; cos and sin carry ``attention_factor``."""
  half = x_btnh.shape[-1] // 2
  angles_bth = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  cos, sin = jnp.cos(angles_bth)[:, :, None, :], jnp.sin(angles_bth)[:, :, None, :]
  if attention_factor != 1.0:
    cos, sin = cos * attention_factor, sin * attention_factor
  x1, x2 = x_btnh[..., :half].astype(jnp.float32), x_btnh[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_btnh.dtype)

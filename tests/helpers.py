"""Shared test helpers."""

import jax
import numpy as np

from asyncrl_jax import models


def sharp_params(config: models.ModelConfig, seed: int, scale: float = 3.0, mesh=None):
  """Random parameters with every matrix scaled up, so attention and logits are far from uniform:
  tests comparing two computations then compare non-trivial numbers."""
  params = models.init_params(config, jax.random.key(seed), mesh=mesh)
  return jax.tree.map(lambda x: x * scale if x.ndim > 1 else x, params)


def max_abs_diff(a, b) -> float:
  """Largest absolute difference between two pytrees of arrays with the same structure."""
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

"""Shared test helpers."""

import jax

from asyncrl_jax import models


def sharp_params(config: models.ModelConfig, seed: int, scale: float = 3.0, mesh=None):
  """Random parameters with every matrix scaled up, so attention and logits are far from uniform:
  tests comparing two computations then compare non-trivial numbers."""
  params = models.init_params(config, jax.random.key(seed), mesh=mesh)
  return jax.tree.map(lambda x: x * scale if x.ndim > 1 else x, params)

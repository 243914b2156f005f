"""Shared test helpers."""

import jax
import numpy as np

from asyncrl_jax import models
from asyncrl_jax.tokenization import ArithmeticTokenizer


class NoStopTokenizer(ArithmeticTokenizer):
  """Never stops on a token, so lengths are controlled by max_new_tokens alone."""
  stop_ids = (-1,)


def sharp_params(config: models.ModelConfig, seed: int, scale: float = 3.0, mesh=None):
  """Random parameters with every matrix scaled up, so attention and logits are far from uniform:
  tests comparing two computations then compare non-trivial numbers."""
  params = models.init_params(config, jax.random.key(seed), mesh=mesh)
  return jax.tree.map(lambda x: x * scale if x.ndim > 1 else x, params)


def max_abs_diff(a, b) -> float:
  """Largest absolute difference between two pytrees of arrays with the same structure."""
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def random_sequences(seed: int, n: int, vocab_size: int, behav_prob=(0.02, 0.5)):
  """``n`` random trajectories as the learner sees them: prompts of 2-5 tokens, completions of 3-39
  sampled at version 0, behaviour probabilities uniform in ``behav_prob``, one advantage each."""
  from asyncrl_jax.rl import batching  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    prompt, completion = int(rng.integers(2, 6)), int(rng.integers(3, 40))
    total = prompt + completion
    mask = np.r_[np.zeros(prompt), np.ones(completion)].astype(np.float32)
    out.append(batching.SequenceData(
        tokens=rng.integers(3, vocab_size, size=total).astype(np.int32), mask=mask,
        behav_logp=np.where(mask > 0, np.log(rng.uniform(*behav_prob, total)), 0).astype(np.float32),
        advantages=np.where(mask > 0, rng.normal(), 0).astype(np.float32),
        versions=np.where(mask > 0, 0, -1).astype(np.int32)))
  return out

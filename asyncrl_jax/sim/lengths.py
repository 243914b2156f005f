"""Trajectory-length distributions for the simulators: a truncated lognormal, or resampled data.

The seed's experiment draws ``min(cap, int(lognormvariate(mu, sigma)))`` tokens per trace; logged
lengths from a real run can be fitted (censored at the cap) or resampled as they are.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class LengthModel:
  """Where trace lengths come from: ``lognormal(mu, sigma)`` floored and capped, or ``samples``."""
  mu: float = 7.4
  sigma: float = 1.15
  cap: int = 32768
  samples: Optional[tuple] = None  # resample these lengths (with replacement) instead

  def __post_init__(self):
    if self.cap < 1:
      raise ValueError(f"cap={self.cap} must be >= 1")
    if self.samples is None and not self.sigma > 0:
      raise ValueError(f"sigma={self.sigma} must be > 0")
    if self.samples is not None and (not len(self.samples) or min(self.samples) < 1):
      raise ValueError("samples must be a non-empty list of lengths >= 1")

  def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` lengths (int64, in ``[1, cap]``)."""
    if self.samples is not None:
      return np.minimum(rng.choice(np.asarray(self.samples, np.int64), size=n), self.cap)
    x = np.floor(rng.lognormal(self.mu, self.sigma, size=n)).astype(np.int64)
    return np.clip(x, 1, self.cap)

  def describe(self) -> str:
    if self.samples is not None:
      return f"{len(self.samples)} logged lengths (resampled), cap {self.cap}"
    return f"lognormal(mu={self.mu:g}, sigma={self.sigma:g}) capped at {self.cap}"


def fit_lognormal(lengths: Sequence[int], cap: int) -> LengthModel:
  """Maximum-likelihood lognormal for lengths censored at ``cap`` (capped traces only say ">= cap").

  Raises:
    ValueError: fewer than two uncensored lengths, or a length outside ``[1, cap]``.
  """
  x = np.asarray(lengths, np.float64)
  if x.size and (x.min() < 1 or x.max() > cap):
    raise ValueError(f"lengths must lie in [1, cap={cap}]; got min {x.min():g}, max {x.max():g}")
  free, censored = np.log(x[x < cap]), int(np.sum(x >= cap))
  if free.size < 2:
    raise ValueError(f"need at least two lengths below the cap to fit; got {free.size}")
  from scipy import optimize, stats  # pylint: disable=import-outside-toplevel

  def nll(theta):
    mu, log_sigma = theta
    sigma = math.exp(log_sigma)
    ll = stats.norm.logpdf(free, mu, sigma).sum()
    if censored:
      ll += censored * stats.norm.logsf(math.log(cap), mu, sigma)
    return -ll

  start = np.array([free.mean(), math.log(max(free.std(), 1e-3))])
  res = optimize.minimize(nll, start, method="Nelder-Mead", options=dict(xatol=1e-6, fatol=1e-9))
  return LengthModel(mu=float(res.x[0]), sigma=float(math.exp(res.x[1])), cap=int(cap))

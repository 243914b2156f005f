"""A latency added to each tool call, drawn from a distribution, for benchmarks of slow environments:

  lognormal:median=0.2,sigma=1.15[,cap=30]     # seconds

``median * exp(sigma * z)``, ``z`` standard normal, at most ``cap`` seconds (default 60)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from asyncrl_jax.data.workloads import parse_fields


@dataclasses.dataclass(frozen=True)
class Latency:
  median: float
  sigma: float
  cap: float = 60.0

  def __post_init__(self):
    if not (math.isfinite(self.median) and self.median >= 0):
      raise ValueError(f"latency median={self.median}: must be a number of seconds >= 0")
    if not (math.isfinite(self.sigma) and self.sigma >= 0):
      raise ValueError(f"latency sigma={self.sigma}: must be a number >= 0")
    if not self.cap > 0:
      raise ValueError(f"latency cap={self.cap}: must be > 0 seconds")

  @classmethod
  def parse(cls, text: str) -> Optional["Latency"]:
    """``"lognormal:median=M,sigma=S[,cap=C]"``, or None for ""."""
    if not text:
      return None
    fields = parse_fields(text, "latency", kinds=("lognormal",), required=("median", "sigma"),
                          optional=("cap",), example="lognormal:median=0.2,sigma=1.15")
    return cls(**fields)

  def draw(self, rng: np.random.Generator) -> float:
    return float(min(self.cap, self.median * math.exp(self.sigma * rng.standard_normal())))

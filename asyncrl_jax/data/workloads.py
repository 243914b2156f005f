"""A synthetic completion-length workload: each rollout's length drawn from a heavy-tailed distribution.

Reasoning traces are heavy-tailed (the seed's: lognormal, mu 7.4, sigma 1.15, capped at 32k, the cap
about 20x the median), and that shape is what makes synchronous RL leave decode slots idle. The
built-in task's completions are short-tailed, so to measure the system on the seed's shape
``rollout.length_workload`` makes each request ask for a drawn length ``L`` as both its minimum and
its maximum (``RolloutRequest.min_new_tokens = max_new_tokens = L``): the decode server generates
exactly ``L`` tokens, with the stop tokens banned until then (a sampling setting the learner applies
too). Only lengths change; prompts, rewards and the loss are the run's own.

  rollout.length_workload = "lognormal:median=32,sigma=1.15,cap=640"

``L = min(cap, max(1, round(median * exp(sigma * z))))``, ``z`` standard normal, drawn from
``(seed, prompt index, sample)``: the same request gets the same length on a rerun or a resume.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

KINDS = ("lognormal",)


def parse_fields(text: str, what: str, *, kinds, required, optional=(), example: str) -> dict:
  """``"KIND:key=number,..."`` -> ``{key: float}``: ``KIND`` one of ``kinds``, every ``required`` key
  given, no key outside ``required`` and ``optional``; a bad spec is named with ``what`` and
  ``example``."""
  kind, _, rest = text.partition(":")
  if kind.strip() not in kinds:
    raise ValueError(f"{what} {text!r}: kind {kind.strip()!r} must be one of {tuple(kinds)} "
                     f"(write it as {example})")
  fields = {}
  for item in filter(None, rest.split(",")):
    key, eq, value = item.partition("=")
    key = key.strip()
    if not eq or key not in (*required, *optional):
      keys = [k + "=" for k in (*required, *optional)]
      raise ValueError(f"{what} {text!r}: {item!r} is not "
                       + (f"{', '.join(keys[:-1])} or {keys[-1]}" if len(keys) > 1 else keys[0]))
    try:
      fields[key] = float(value)
    except ValueError:
      raise ValueError(f"{what} {text!r}: {key}={value!r} is not a number") from None
  missing = set(required) - set(fields)
  if missing:
    raise ValueError(f"{what} {text!r}: missing {', '.join(sorted(missing))} (write it as {example})")
  return fields


@dataclasses.dataclass(frozen=True)
class LengthWorkload:
  median: float
  sigma: float
  cap: int
  kind: str = "lognormal"

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"length workload kind {self.kind!r}: must be one of {KINDS}")
    if not (math.isfinite(self.median) and self.median >= 1):
      raise ValueError(f"length workload median={self.median}: must be a number >= 1")
    if not (math.isfinite(self.sigma) and self.sigma >= 0):
      raise ValueError(f"length workload sigma={self.sigma}: must be a number >= 0")
    if self.cap < 1:
      raise ValueError(f"length workload cap={self.cap}: must be an integer >= 1")

  @classmethod
  def parse(cls, text: str) -> Optional["LengthWorkload"]:
    """``"lognormal:median=M,sigma=S,cap=C"`` (all three needed), or None for ""."""
    if not text:
      return None
    fields = parse_fields(text, "length workload", kinds=KINDS, required=("median", "sigma", "cap"),
                          example="lognormal:median=32,sigma=1.15,cap=640")
    if fields["cap"] != int(fields["cap"]):
      raise ValueError(f"length workload {text!r}: cap={fields['cap']} is not an integer")
    return cls(median=fields["median"], sigma=fields["sigma"], cap=int(fields["cap"]),
               kind=text.partition(":")[0].strip())

  @property
  def spec(self) -> str:
    return f"{self.kind}:median={self.median:g},sigma={self.sigma:g},cap={self.cap}"

  def _clip(self, z):
    return np.clip(np.round(self.median * np.exp(self.sigma * np.asarray(z))), 1, self.cap).astype(np.int64)

  def draw(self, seed: int, prompt_index: int, sample: int) -> int:
    """The length of sample ``sample`` of prompt ``prompt_index`` in a run seeded ``seed``."""
    z = np.random.default_rng([int(seed) % 2**32, int(prompt_index), int(sample)]).standard_normal()
    return int(self._clip(z))

  def sample(self, n: int, seed: int = 0) -> np.ndarray:
    """``n`` lengths at once (for the simulator and the planner)."""
    return self._clip(np.random.default_rng(seed).standard_normal(n))

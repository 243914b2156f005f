"""The health monitor: the signatures of a collapsing run, flagged per version.

Training under staleness fails quietly: the loss stays finite and the run goes on while held-out
accuracy slides (the seeds' naive-PPO arm at eta 4 lost half its score without a crash). This reads
each version's metrics record and raises an ``Alarm`` when one of these signatures appears:

* ``train_reward``: the batch reward, averaged over the last ``window`` versions, has fallen from its
  best such average by more than ``reward_drop``;
* ``eval_accuracy``: held-out accuracy has fallen from its best evaluation by more than ``eval_drop``;
* ``entropy``: the policy's mean token entropy (window average) is below ``entropy_floor`` times its
  first window's (the policy becoming deterministic, often the prelude to collapse);
* ``entropy_rise``: it is above ``entropy_ceiling`` times its first window's (the policy dissolving
  into noise: how the seeds' naive baseline collapsed under staleness on the built-in task, entropy
  0.63 -> 1.1-1.25 while held-out accuracy fell from 34% to 12%);
* ``truncated``: the share of completions cut by the length budget (window average) exceeds
  ``truncated_max`` (completions blowing up to the cap);
* ``ratio_p99``: the 99th percentile of ``pi_theta / pi_behav`` (window average) exceeds
  ``ratio_p99_max`` (the data has drifted far from the policy being trained);
* ``masked``: the share of policy tokens the objective gave weight 0 (window average) exceeds
  ``masked_max`` (the update learns from a shrinking, biased part of the batch).

A signal alarms once when it starts and again only after it has cleared, so a long collapse does not
flood the log. Window averages start at the first full window. Thresholds come from the ``monitor``
config section (0 or inf turns one off); ``learner.stop_on_alarm`` makes the main job save a
checkpoint and stop at the first alarm, naming it. The monitor keeps no state beyond what the
records hold: on resume it replays the run's history.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional

SIGNALS = ("train_reward", "eval_accuracy", "entropy", "entropy_rise", "truncated", "ratio_p99", "masked")


@dataclasses.dataclass(frozen=True)
class Thresholds:
  window: int = 5
  reward_drop: float = 0.15
  eval_drop: float = 0.10
  entropy_floor: float = 0.2
  entropy_ceiling: float = 1.5
  truncated_max: float = 0.5
  ratio_p99_max: float = 10.0
  masked_max: float = 0.5

  @classmethod
  def from_config(cls, config) -> "Thresholds":
    m = config.monitor
    return cls(window=int(m.window), reward_drop=float(m.reward_drop), eval_drop=float(m.eval_drop),
               entropy_floor=float(m.entropy_floor), entropy_ceiling=float(m.entropy_ceiling),
               truncated_max=float(m.truncated_max),
               ratio_p99_max=float(m.ratio_p99_max), masked_max=float(m.masked_max))


@dataclasses.dataclass(frozen=True)
class Alarm:
  signal: str  # one of SIGNALS
  version: int  # the record's version (the learner's version after the update)
  detail: str  # what was seen against what bound

  def __str__(self) -> str:
    return f"{self.signal} at version {self.version}: {self.detail}"


def _on(x: float) -> bool:
  return x > 0 and math.isfinite(x)


class HealthMonitor:
  """Feed ``observe(record)`` every version's metrics record, in order; it returns the new alarms."""

  def __init__(self, thresholds: Thresholds, history: Iterable[dict] = ()):
    self.t = thresholds
    self._series: dict[str, list] = {k: [] for k in ("reward", "entropy", "truncated_frac",
                                                        "ratio_p99", "dropped_frac")}
    self._best_reward: Optional[float] = None
    self._best_eval: Optional[float] = None
    self._first_entropy: Optional[float] = None
    self._active: set[str] = set()
    self.alarms: list[Alarm] = []
    for record in history:
      self.observe(record)

  def _window(self, key: str) -> Optional[float]:
    values = self._series[key]
    if len(values) < self.t.window:
      return None
    tail = values[-self.t.window:]
    return sum(tail) / len(tail)

  def observe(self, record: dict) -> list[Alarm]:
    for key, values in self._series.items():
      if record.get(key) is not None and math.isfinite(record[key]):
        values.append(float(record[key]))
    firing = {}
    reward = self._window("reward")
    if reward is not None:
      self._best_reward = reward if self._best_reward is None else max(self._best_reward, reward)
      if _on(self.t.reward_drop) and reward < self._best_reward - self.t.reward_drop:
        firing["train_reward"] = (f"batch reward {reward:.3f} (mean of {self.t.window} versions) is "
                                  f"{self._best_reward - reward:.3f} below its best {self._best_reward:.3f}"
                                  f" (monitor.reward_drop={self.t.reward_drop})")
    if record.get("eval_accuracy") is not None:
      acc = float(record["eval_accuracy"])
      self._best_eval = acc if self._best_eval is None else max(self._best_eval, acc)
      if _on(self.t.eval_drop) and acc < self._best_eval - self.t.eval_drop:
        firing["eval_accuracy"] = (f"held-out accuracy {acc:.3f} is {self._best_eval - acc:.3f} below its "
                                   f"best {self._best_eval:.3f} (monitor.eval_drop={self.t.eval_drop})")
      elif "eval_accuracy" in self._active:  # (cleared only by a new evaluation)
        self._active.discard("eval_accuracy")
    elif "eval_accuracy" in self._active:
      firing["eval_accuracy"] = ""  # (no new evaluation: the alarm stands)
    entropy = self._window("entropy")
    if entropy is not None:
      if self._first_entropy is None:
        self._first_entropy = entropy
      if _on(self.t.entropy_floor) and entropy < self.t.entropy_floor * self._first_entropy:
        firing["entropy"] = (f"mean token entropy {entropy:.4f} is below {self.t.entropy_floor} x its "
                             f"first {self.t.window} versions' {self._first_entropy:.4f} "
                             "(monitor.entropy_floor)")
      if _on(self.t.entropy_ceiling) and entropy > self.t.entropy_ceiling * self._first_entropy:
        firing["entropy_rise"] = (f"mean token entropy {entropy:.4f} is above {self.t.entropy_ceiling} x "
                                  f"its first {self.t.window} versions' {self._first_entropy:.4f} "
                                  "(monitor.entropy_ceiling)")
    for signal, key, bound, what in (
        ("truncated", "truncated_frac", self.t.truncated_max, "share of completions cut by the length "
         "budget"),
        ("ratio_p99", "ratio_p99", self.t.ratio_p99_max, "99th percentile of pi_theta / pi_behav"),
        ("masked", "dropped_frac", self.t.masked_max, "share of policy tokens given weight 0")):
      value = self._window(key)
      if value is not None and _on(bound) and value > bound:
        firing[signal] = (f"{what} {value:.3g} (mean of {self.t.window} versions) exceeds "
                          f"monitor.{signal}_max={bound}")
    new = [Alarm(s, int(record.get("version", -1)), firing[s]) for s in SIGNALS
           if s in firing and s not in self._active]
    self._active = set(firing)
    self.alarms += new
    return new

  @property
  def active(self) -> list[str]:
    """The signals alarming as of the last record, in ``SIGNALS`` order."""
    return [s for s in SIGNALS if s in self._active]

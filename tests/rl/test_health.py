"""The health monitor: quiet on a healthy run, each planted signature of collapse fires its own alarm
(and no other) at the version worked out by hand, once per episode, and the same after a resume."""

import math

import numpy as np
import pytest

from asyncrl_jax.rl.health import SIGNALS, HealthMonitor, Thresholds


def healthy(n=80, seed=0):
  """Records shaped like the built-in task's default run: reward rising noisily 0.30 -> 0.45,
  entropy drifting down 0.60 -> 0.45, a few truncated completions, mild drift, held-out every 10."""
  rng = np.random.default_rng(seed)
  records = []
  for v in range(1, n + 1):
    t = v / n
    r = dict(version=v, reward=0.30 + 0.15 * t + rng.normal(0, 0.03),
             entropy=0.60 - 0.15 * t + rng.normal(0, 0.01), truncated_frac=0.08 + rng.normal(0, 0.02),
             ratio_p99=1.4 + rng.normal(0, 0.1), dropped_frac=0.01)
    if v % 10 == 0:
      r["eval_accuracy"] = 0.34 + 0.12 * t + rng.normal(0, 0.01)
    records.append(r)
  return records


def _alarms(records, **thresholds):
  monitor = HealthMonitor(Thresholds(**thresholds))
  return [a for r in records for a in monitor.observe(r)]


@pytest.mark.parametrize("seed", range(5))
def test_quiet_on_a_healthy_run(seed):
  assert _alarms(healthy(seed=seed)) == []


def _plant(signal, records, start=50):
  out = [dict(r) for r in records]
  for r in out[start:]:
    k = r["version"] - start  # 1, 2, ... versions into the collapse
    if signal == "train_reward":
      r["reward"] = 0.45 - 0.04 * k
    elif signal == "eval_accuracy" and "eval_accuracy" in r:
      r["eval_accuracy"] = 0.2
    elif signal == "entropy":
      r["entropy"] = 0.45 * 0.5 ** k
    elif signal == "entropy_rise":
      r["entropy"] = 0.45 + 0.1 * k
    elif signal == "truncated":
      r["truncated_frac"] = 1.0
    elif signal == "ratio_p99":
      r["ratio_p99"] = 100.0
    elif signal == "masked":
      r["dropped_frac"] = 0.9
  return out


def _first_version_past(records, key, bound, window=5, above=True, start=50):
  """The version at which ``key``'s mean over the last ``window`` records first crosses ``bound``
  (worked out from the records, independently of the monitor)."""
  for i in range(start, len(records)):
    mean = np.mean([r[key] for r in records[i - window + 1:i + 1]])
    if (mean > bound) if above else (mean < bound):
      return records[i]["version"]
  return None


@pytest.mark.parametrize("signal", SIGNALS)
def test_each_planted_collapse_fires_its_own_alarm_once(signal):
  records = _plant(signal, healthy())
  alarms = _alarms(records)
  assert [a.signal for a in alarms] == [signal], alarms  # that one, once, and no other
  version = alarms[0].version
  if signal in ("truncated", "ratio_p99", "masked"):  # a window mean past a fixed bound
    key, bound = {"truncated": ("truncated_frac", 0.5), "ratio_p99": ("ratio_p99", 10.0),
                  "masked": ("dropped_frac", 0.5)}[signal]
    assert version == _first_version_past(records, key, bound)
  elif signal == "eval_accuracy":  # the first evaluation after the plant (version 60)
    assert version == 60
  elif signal == "train_reward":  # its window mean 0.15 below the best window mean so far
    means = [np.mean([r["reward"] for r in records[i - 4:i + 1]]) for i in range(4, len(records))]
    best = np.maximum.accumulate(means)
    assert version == records[4 + int(np.argmax(np.array(means) < best - 0.15))]["version"]
  elif signal == "entropy":
    first = np.mean([r["entropy"] for r in records[:5]])
    assert version == _first_version_past(records, "entropy", 0.2 * first, above=False)
  elif signal == "entropy_rise":
    first = np.mean([r["entropy"] for r in records[:5]])
    assert version == _first_version_past(records, "entropy", 1.5 * first)
  assert version > 50 and str(alarms[0]).startswith(f"{signal} at version {version}: ")


def test_a_signal_alarms_again_only_after_it_cleared():
  records = healthy()
  for r in records[40:45] + records[60:65]:
    r["ratio_p99"] = 1000.0
  alarms = _alarms(records, window=1, reward_drop=0.0)  # (single noisy rewards would alarm too)
  assert [(a.signal, a.version) for a in alarms] == [("ratio_p99", 41), ("ratio_p99", 61)]


def test_a_threshold_of_zero_or_inf_turns_a_signal_off():
  records = _plant("masked", _plant("truncated", healthy()))
  assert {a.signal for a in _alarms(records)} == {"masked", "truncated"}
  assert [a.signal for a in _alarms(records, masked_max=0.0)] == ["truncated"]
  assert [a.signal for a in _alarms(records, truncated_max=math.inf)] == ["masked"]


def test_a_resumed_monitor_replays_the_history():
  records = _plant("train_reward", healthy())
  whole = _alarms(records)
  resumed = HealthMonitor(Thresholds(), records[:55])  # (the checkpoint's history)
  later = [a for r in records[55:] for a in resumed.observe(r)]
  assert resumed.alarms == whole and (later == [] or later == whole[-len(later):])

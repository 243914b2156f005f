"""Slow environments: synchronous group RL versus asynchronous RL and single-rollout value mode on the
tool task when every tool call takes a heavy-tailed time, through the real system, side by side.

  .venv/bin/python benchmarks/slow_tools.py [--quick]

One supervised warm start first (``python -m asyncrl_jax.sft`` on configs/tool_use.py), so every arm
starts from the same policy. Then each arm is the main job for the same number of policy versions,
every calculator call waiting a draw of ``lognormal(median, sigma)`` seconds (``env.options``
``latency``; default median 0.2 s, sigma 1.15, the seed's shape) with one environment worker per
decode slot:

* ``sync, no latency``: eta 0 with instant tools (the reference the predictions start from);
* ``sync``: eta 0, group advantages (a batch waits for its slowest episode);
* ``eta 2``, ``eta 4``: asynchronous, group advantages (a group still waits for its slowest member
  before it is scored, but generation goes on meanwhile);
* ``value``: eta 2, value advantages with one rollout per prompt (no group barrier at all).

Per arm, over the versions after ``--skip``: trained tokens/s, learner idle fraction, decode-slot
utilization (tokens per slot-step, times the share of time the servers had work: a slot parked for
its environment produces nothing), episodes waiting on a tool (mean, by Little's law: environment
seconds / wall seconds) and the group wait the seed defines (per group, the mean over its members of
the group's last finish time minus the member's own; 0 for single rollouts).

Predictions are the simulator's (``asyncrl_jax.sim.straggler`` with slots parked on their
environments), from the latency distribution and the no-latency reference alone: the reference's
completion lengths, slots and batch; its learner seconds per version (busy share x seconds per
version) and the seconds of one decode step (its decode seconds per version over the simulated
makespan of a batch); each episode's tool time the sum of its calls' draws (calls per episode as the
reference made them), in decode steps, holding its slot without decoding. The synchronous arm:
learner seconds plus the simulated makespan with the parked time, and its group wait; the
asynchronous arms: the simulated trained tokens per step at their eta, with the learner's rate
taken from the reference (as if decoding and training had separate devices: on this machine they
share the cores, so these are upper bounds).
Writes benchmarks/results/slow_tools.{json,md,png}; prints one JSON object (last line).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from asyncrl_jax.sim import planner, straggler  # noqa: E402  pylint: disable=wrong-import-position
from asyncrl_jax.sim.lengths import LengthModel  # noqa: E402  pylint: disable=wrong-import-position
from benchmarks.async_vs_sync import _records, window_metrics  # noqa: E402  pylint: disable=wrong-import-position
from benchmarks.common import machine, pyplot, run_logged, write_result  # noqa: E402  pylint: disable=wrong-import-position

CONFIG = os.path.join(ROOT, "configs", "tool_use.py")


def group_wait(finished_at: list, group_size: int) -> float:
  """The seed's mean extra wait: per group (consecutive ``group_size`` finish times), the mean of
  ``max - t`` over its members, averaged over groups."""
  if group_size < 2 or not finished_at:
    return 0.0
  t = np.asarray(finished_at, np.float64).reshape(-1, group_size)
  return float((t.max(axis=1, keepdims=True) - t).mean())


def arm_group_wait(workdir: str, group_size: int, skip: int) -> float:
  waits = [group_wait(r["finished_at"], group_size)
           for r in _records(os.path.join(workdir, "trained_prompts.jsonl"))[skip + 1:]]
  return float(np.mean(waits)) if waits else 0.0


def episode_tool_seconds(rng: np.random.Generator, n: int, calls_per_episode: float, median: float,
                         sigma: float) -> np.ndarray:
  """Tool time of ``n`` episodes: each makes ``floor(c)`` or ``ceil(c)`` calls (mean ``c``), each
  call a lognormal draw."""
  base = math.floor(calls_per_episode)
  calls = base + (rng.random(n) < calls_per_episode - base)
  draws = rng.lognormal(math.log(median), sigma, size=(n, base + 1))
  return (draws * (np.arange(base + 1)[None] < calls[:, None])).sum(axis=1)


def predictions(*, lengths: list, slots: int, batch: int, group_size: int, calls_per_episode: float,
                median: float, sigma: float, reference: dict, etas=(2, 4), epochs: int = 200,
                seed: int = 0) -> dict:
  """The simulator's predictions for the latency arms, calibrated on the no-latency reference (see
  the module's docstring)."""
  model = LengthModel(samples=tuple(int(x) for x in lengths), cap=max(int(x) for x in lengths))
  seconds = reference["seconds_per_version"]
  learner_s = (1.0 - reference["learner_idle_fraction"]) * seconds
  base = straggler.simulate_sync(model, epochs=epochs, batch=batch, slots=slots, seed=seed)
  step = (seconds - learner_s) / base.decode_steps_per_epoch

  def park(rng, n):
    return episode_tool_seconds(rng, n, calls_per_episode, median, sigma) / step

  sync = straggler.simulate_sync(model, epochs=epochs, batch=batch, slots=slots, seed=seed, park=park,
                                 group_size=group_size)
  tokens_per_version = reference["trained_tokens"] / reference["versions"]
  train_rate = tokens_per_version / max(learner_s / step, 1e-9)  # trained tokens per decode step
  runs = {eta: straggler.simulate_async(model, epochs=epochs, batch=batch, slots=slots, eta=eta, seed=seed,
                                        train_rate=train_rate, park=park) for eta in etas}
  sync_seconds = learner_s + sync.decode_steps_per_epoch * step
  return {"step_seconds": step, "group_wait_seconds": sync.group_wait * step,
          "sync_seconds_per_version": sync_seconds, "sync_tokens_per_s": tokens_per_version / sync_seconds,
          "sync_slot_utilization": sync.slot_utilization,
          "async": {f"eta {eta}": {"tokens_per_s": r.tokens_per_step / step,
                                   "slot_utilization": r.slot_utilization,
                                   "learner_idle_fraction": r.learner_idle_fraction}
                    for eta, r in runs.items()}}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="fewer versions per arm (a few minutes each)")
  p.add_argument("--steps", type=int, default=None, help="policy versions per arm (default 24; quick 12)")
  p.add_argument("--skip", type=int, default=None, help="versions excluded from timing (default 3)")
  p.add_argument("--median", type=float, default=0.2, help="median seconds of a tool call")
  p.add_argument("--sigma", type=float, default=1.15, help="sigma of the log of a tool call's seconds")
  p.add_argument("--warm-start-steps", type=int, default=400)
  p.add_argument("--workdir", default="", help="keep the runs here (default: a temporary directory)")
  p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
  p.add_argument("--override", action="append", default=[], help="extra --config.x=y for every arm")
  args = p.parse_args(argv)
  steps = args.steps or (12 if args.quick else 24)
  skip = args.skip if args.skip is not None else 3
  work = args.workdir or tempfile.mkdtemp(prefix="slow_tools_")
  os.makedirs(work, exist_ok=True)
  py, t0 = sys.executable, time.time()
  data = [f"--config.data.path={os.path.join(work, 'data')}"]  # prepared once, read by every arm
  print(f"[slow_tools] warm start ({args.warm_start_steps} steps) in {work}", flush=True)
  if not os.path.exists(os.path.join(work, "warm_start", "config.json")):
    run_logged([py, "-m", "asyncrl_jax.sft", f"--config={CONFIG}", f"--workdir={work}",
                f"--config.learner.warm_start_steps={args.warm_start_steps}", *data, *args.override],
               os.path.join(work, "sft.log"))
  latency = json.dumps({"latency": f"lognormal:median={args.median:g},sigma={args.sigma:g}"})
  common = [f"--config.model.hf_path={os.path.join(work, 'warm_start')}", f"--config.steps={steps}",
            f"--config.learner.eval_every={10 * steps}", f"--config.checkpoint.every_steps={10 * steps}",
            *data, *args.override]
  specs = [("sync, no latency", ["--config.rl.max_staleness=0"]),
           ("sync", ["--config.rl.max_staleness=0", f"--config.env.options={latency}"]),
           ("eta 2", ["--config.rl.max_staleness=2", f"--config.env.options={latency}"]),
           ("eta 4", ["--config.rl.max_staleness=4", f"--config.env.options={latency}"]),
           ("value", ["--config.rl.max_staleness=2", "--config.rl.advantage=value",
                      "--config.rl.group_size=1", f"--config.env.options={latency}"])]
  arms = {}
  for label, flags in specs:
    name = label.replace(", ", "_").replace(" ", "_")
    wd = os.path.join(work, name)
    print(f"[slow_tools] {label}: {steps} policy versions ({time.time() - t0:.0f}s so far)", flush=True)
    run_logged([py, "-m", "asyncrl_jax.train", f"--config={CONFIG}", f"--workdir={wd}", *common, *flags],
               os.path.join(work, f"{name}.log"))
    records = _records(os.path.join(wd, "metrics.jsonl"))
    m = window_metrics(records, skip)
    with open(os.path.join(wd, "config.json")) as f:
      config = json.load(f)
    group_size = config["rl"]["group_size"]
    window = records[skip + 1:]
    env_seconds = window[-1]["decode_env_seconds"] - records[skip]["decode_env_seconds"]
    m.update(group_size=group_size, group_wait_seconds=arm_group_wait(wd, group_size, skip),
             episodes_waiting_on_tools=env_seconds / m["seconds"],
             seconds_per_version=m["seconds"] / len(window),
             tool_calls_per_episode=float(np.mean([r.get("tool_calls_per_episode", 0.0) for r in window])),
             batch=config["learner"]["batch_size"], slots=config["rollout"]["num_slots"], versions=len(window))
    if label == "sync, no latency":
      reference_lengths = planner.lengths_from_log(os.path.join(wd, "trained_prompts.jsonl"))
    arms[label] = m
  ref = arms["sync, no latency"]
  predicted = predictions(lengths=reference_lengths, slots=ref["slots"], batch=ref["batch"],
                          group_size=arms["sync"]["group_size"],
                          calls_per_episode=ref["tool_calls_per_episode"], median=args.median,
                          sigma=args.sigma, reference=ref)
  sync = arms["sync"]
  result = dict(machine=machine(), config=dict(config=os.path.relpath(CONFIG, ROOT), steps=steps, skip=skip,
                                               median=args.median, sigma=args.sigma,
                                               overrides=args.override),
                arms=arms, predicted=predicted,
                ratios={k: a["tokens_per_s"] / sync["tokens_per_s"] for k, a in arms.items()})
  rows = [(label, a["tokens_per_s"], result["ratios"][label], a["seconds_per_version"],
           a["learner_idle_fraction"], a["slot_utilization"], a["episodes_waiting_on_tools"],
           a["group_wait_seconds"], a["max_staleness_seen"]) for label, a in arms.items()]
  notes = (f"Tool task (configs/tool_use.py), every calculator call waiting lognormal(median "
           f"{args.median:g} s, sigma {args.sigma:g}); {steps} policy versions per arm, the first {skip} "
           f"excluded from timing; one warm start shared by all arms. The simulator (slots parked on "
           f"their tools, calibrated on the no-latency reference: one decode step "
           f"{predicted['step_seconds'] * 1e3:.1f} ms) predicts: group wait {predicted['group_wait_seconds']:.2f} s "
           f"(measured in the sync arm: {sync['group_wait_seconds']:.2f} s); synchronous seconds per "
           f"version {predicted['sync_seconds_per_version']:.2f} (measured {sync['seconds_per_version']:.2f}); "
           + "; ".join(f"{k} {v['tokens_per_s']:.0f} trained tokens/s (measured {arms[k]['tokens_per_s']:.0f})"
                       for k, v in predicted["async"].items() if k in arms)
           + ". The asynchronous predictions give decoding and training separate devices; here they "
           "share 2 cores, so they are upper bounds.")
  md = write_result("slow_tools", result,
                    ["arm", "trained tok/s", "x sync", "s / version", "learner idle", "slot utilization",
                     "episodes waiting on tools", "group wait (s)", "max staleness"], rows, notes,
                    **({"out_dir": args.out} if args.out else {}))
  _plot(arms, os.path.join(os.path.dirname(md), "slow_tools.png"))
  print(json.dumps(dict(result, md=md)))
  return 0


def _plot(arms: dict, path: str) -> None:
  plt = pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  labels = list(arms)
  for ax, key, title in zip(axes, ("tokens_per_s", "slot_utilization", "group_wait_seconds"),
                            ("trained tokens/s", "decode-slot utilization", "group wait (s)")):
    ax.bar(range(len(labels)), [arms[k][key] for k in labels], color="tab:blue")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())

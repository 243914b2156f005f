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

Predictions, from the latency distribution and the no-latency reference alone: the group wait of
``group_size`` episodes whose tool time is the sum of their calls' draws (calls per episode as the
reference arm made them; decode time differences ignored), and the synchronous arm's seconds per
version, the reference's plus the expected slowest tool time among a batch's episodes.
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


def predictions(*, group_size: int, batch: int, calls_per_episode: float, median: float, sigma: float,
                reference_seconds_per_version: float, trials: int = 2000, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  groups = episode_tool_seconds(rng, trials * group_size, calls_per_episode, median, sigma)
  waits = [group_wait(groups[i * group_size:(i + 1) * group_size].tolist(), group_size)
           for i in range(trials)]
  slowest = [episode_tool_seconds(rng, batch, calls_per_episode, median, sigma).max()
             for _ in range(trials // 10)]
  return {"group_wait_seconds": float(np.mean(waits)),
          "sync_seconds_per_version": reference_seconds_per_version + float(np.mean(slowest)),
          "mean_tool_seconds_per_episode": float(groups.mean())}


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
             batch=config["learner"]["batch_size"], slots=config["rollout"]["num_slots"])
    arms[label] = m
  ref = arms["sync, no latency"]
  predicted = predictions(group_size=arms["sync"]["group_size"], batch=ref["batch"],
                          calls_per_episode=ref["tool_calls_per_episode"], median=args.median,
                          sigma=args.sigma, reference_seconds_per_version=ref["seconds_per_version"])
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
           f"excluded from timing; one warm start shared by all arms. Predicted from the latency "
           f"distribution and the no-latency reference: group wait {predicted['group_wait_seconds']:.2f} s "
           f"(measured in the sync arm: {sync['group_wait_seconds']:.2f} s); synchronous seconds per "
           f"version {predicted['sync_seconds_per_version']:.2f} (measured {sync['seconds_per_version']:.2f}).")
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

"""What the tool buys: RL with the calculator beside two controls at the same budget.

  .venv/bin/python benchmarks/tool_controls.py --seeds 3     # about 75 minutes on 2 cores
  .venv/bin/python benchmarks/tool_controls.py --seeds 3 --workdir=/data/tool_controls

The task is configs/tool_use.py: sums of 4-5 numbers of up to 3 digits, a 2-layer model over the
built-in tool vocabulary, a supervised warm start on demonstrations of 2-3-term sums with calculator
calls (no loss on the calculator's answers). From that one warm start, per seed:

* ``rl``: the main job (configs/tool_use.py) for ``--steps`` policy versions;
* ``rl_blind_tool``: the same RL, where every calculator call answers nothing (``constant_output=""``:
  the call is made, the observation is empty), so the policy must add the numbers itself;
* ``sft_more``: more supervised training on the demonstrations for the ``rl`` arm's wall time (its
  RL phase and final evaluation).

Every arm is evaluated the same way (held-out pass@1, 4 samples at T=1, on 128 problems of 4-5
terms, with their greedy accuracy). Writes benchmarks/results/tool_controls.{json,md}; prints one
JSON object (last line). A rerun with the same --workdir reuses finished arms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from asyncrl_jax import cli  # noqa: E402  pylint: disable=wrong-import-position

cli.ensure_cpu_devices(4)

from benchmarks.common import machine, percent_cell, read_json, run_logged, write_result  # noqa: E402  pylint: disable=wrong-import-position

CONFIG = os.path.join(ROOT, "configs", "tool_use.py")
BLIND = '--config.env.options={"constant_output": ""}'


def _rl(py, common, wd, seed, steps, extra, log):
  if not os.path.exists(os.path.join(wd, "summary.json")):
    run_logged([py, "-m", "asyncrl_jax.train", *common, f"--workdir={wd}", f"--config.seed={seed}",
                f"--config.steps={steps}", f"--config.learner.eval_every={max(1, steps // 4)}",
                f"--config.checkpoint.every_steps={steps}", *extra], log)
  s = read_json(os.path.join(wd, "summary.json"))
  if s["steps"] != steps:
    raise SystemExit(f"{wd} holds a run of {s['steps']} versions, not {steps}: use another --workdir")
  return dict(seed=seed, seconds=s["rl_seconds_this_run"], steps=s["steps"], final=s["final_eval_accuracy"],
              final_greedy=s["final_eval_greedy_accuracy"],
              tool_calls_per_episode=s.get("tool_calls_per_episode"),
              turns_per_episode=s.get("turns_per_episode"))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=200, help="policy versions of the RL arms (default 200)")
  p.add_argument("--seeds", type=int, default=1, help="seeds per arm (default 1)")
  p.add_argument("--workdir", default="", help="keep the runs here; a rerun reuses finished arms")
  p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
  p.add_argument("--override", action="append", default=[], help="extra --config.x=y for every arm")
  args = p.parse_args(argv)
  work = args.workdir or tempfile.mkdtemp(prefix="tool_controls_")
  os.makedirs(work, exist_ok=True)
  py, t0 = sys.executable, time.time()
  data = os.path.join(work, "data")
  ws_dir = os.path.join(work, "ws")
  ws = os.path.join(ws_dir, "warm_start")
  if not os.path.exists(os.path.join(ws_dir, "sft_summary.json")):
    print(f"[tool_controls] warm start on demonstrations of 2-3-term sums in {work}", flush=True)
    run_logged([py, "-m", "asyncrl_jax.sft", f"--config={CONFIG}", f"--workdir={ws_dir}",
                f"--config.data.path={data}", "--evaluate", *args.override], os.path.join(work, "ws.log"))
  warm = read_json(os.path.join(ws_dir, "sft_summary.json"))
  common = [f"--config={CONFIG}", f"--config.model.hf_path={ws}", f"--config.data.path={data}", *args.override]
  arms = {"rl": [], "rl_blind_tool": [], "sft_more": []}
  for seed in range(args.seeds):
    print(f"[tool_controls] rl seed {seed} ({time.time() - t0:.0f}s so far)", flush=True)
    arms["rl"].append(_rl(py, common, os.path.join(work, f"rl_seed{seed}"), seed, args.steps, [],
                          os.path.join(work, f"rl_seed{seed}.log")))
    print(f"[tool_controls] rl_blind_tool seed {seed} ({time.time() - t0:.0f}s so far)", flush=True)
    arms["rl_blind_tool"].append(_rl(py, common, os.path.join(work, f"blind_seed{seed}"), seed, args.steps,
                                     [BLIND], os.path.join(work, f"blind_seed{seed}.log")))
    budget = arms["rl"][-1]["seconds"]
    cd = os.path.join(work, f"sft_more_seed{seed}")
    print(f"[tool_controls] sft_more seed {seed}: {budget:.0f}s ({time.time() - t0:.0f}s so far)", flush=True)
    if not os.path.exists(os.path.join(cd, "sft_summary.json")):
      run_logged([py, "-m", "asyncrl_jax.sft", *common, f"--workdir={cd}", f"--config.seed={seed}",
                  "--config.learner.warm_start_steps=1000000", f"--max_seconds={budget}", "--evaluate",
                  "--schedule=constant"], os.path.join(work, f"sft_more{seed}.log"))
    c = read_json(os.path.join(cd, "sft_summary.json"))
    arms["sft_more"].append(dict(seed=seed, seconds=c["seconds"], steps=c["steps"], final=c["final_eval_accuracy"],
                                 final_greedy=c["final_eval_greedy_accuracy"]))
  header = ["arm", "seeds", "held-out pass@1 (mean +- sd)", "greedy", "tool calls / turns per episode",
            "seconds", "versions or steps"]
  rows = [["warm start (demonstrations of 2-3 terms)", 1, percent_cell([warm["final_eval_accuracy"]]),
           percent_cell([warm["final_eval_greedy_accuracy"]]), "", f"{warm['seconds']:.0f}", warm["steps"]]]
  for arm, runs in arms.items():
    calls = ("" if runs[0].get("tool_calls_per_episode") is None else
             f"{np.mean([r['tool_calls_per_episode'] for r in runs]):.2f} / "
             f"{np.mean([r['turns_per_episode'] for r in runs]):.2f}")
    rows.append([arm, len(runs), percent_cell([r["final"] for r in runs]),
                 percent_cell([r["final_greedy"] for r in runs]), calls,
                 f"{np.mean([r['seconds'] for r in runs]):.0f}", f"{np.mean([r['steps'] for r in runs]):.0f}"])
  mean = {arm: float(np.mean([r["final"] for r in runs])) for arm, runs in arms.items()}
  notes = (f"configs/tool_use.py from one warm start (demonstrations of 2-3-term sums with calculator calls; "
           f"no loss on the calculator's answers); held-out problems of 4-5 terms. `rl`: the main job for "
           f"{args.steps} versions; `rl_blind_tool`: the same, every calculator call answering nothing "
           "(`env.options` `constant_output=\"\"`); `sft_more`: more supervised training on the "
           "demonstrations for the `rl` arm's wall time (its RL phase and final evaluation). Held-out "
           "pass@1 in % (4 samples at T=1, 128 problems), mean +- sd over seeds. What the tool buys: "
           f"{100 * (mean['rl'] - mean['rl_blind_tool']):+.1f} points of pass@1 over RL without its answers, "
           f"{100 * (mean['rl'] - mean['sft_more']):+.1f} over more supervised training. A rerun with the "
           "same --workdir reuses finished arms.")
  result = dict(machine=machine(), config=dict(config=os.path.relpath(CONFIG, ROOT), steps=args.steps,
                                               seeds=args.seeds, overrides=args.override),
                warm_start=warm, arms=arms, seconds=time.time() - t0)
  md = write_result("tool_controls", result, header, rows, notes, **({"out_dir": args.out} if args.out else {}))
  print(f"[tool_controls] wrote {md}")
  print(json.dumps({"warm_start": warm["final_eval_accuracy"], **mean}))
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""RL against its honest supervised controls where demonstrations stop: long chains, short demonstrations.

  .venv/bin/python benchmarks/rl_vs_rft.py            # about 30 minutes on 2 cores
  .venv/bin/python benchmarks/rl_vs_rft.py --seeds 3 --workdir=/data/rl_vs_rft

The task is configs/long_chains.py: the supervised warm start sees worked solutions of chains of 2-4
terms only; prompts and held-out problems have 5-10 terms. From that one warm start, per seed:

* ``rl``: the main job (configs/long_chains.py, ``--rl-override`` for other objectives) for
  ``--steps`` policy versions;
* ``rft``: rejection-sampling fine-tuning (``python -m asyncrl_jax.sft --rft``): the model's own correct,
  finished samples of the same training prompts, drawn as the decode servers draw them, trained on with
  the warm start's loss, for the RL arm's wall time (its RL phase with its final evaluation);
* ``sft_short``: more supervised training on the short demonstrations, for the same wall time (what
  the demonstrations alone can do).

Every arm is evaluated the same way, as the config evaluates a run's last version (all 500 held-out
problems of 5-10 terms, 4 samples at T=1; ``--override=--config.data.final_eval_samples=16`` for a
pass@1 standard error near half a point), and the table gives each arm's SE; arms evaluated
differently (an older workdir) are refused. Writes benchmarks/results/rl_vs_rft.{json,md}; prints one JSON object (last line). A rerun with
the same --workdir reuses finished arms.
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

CONFIG = os.path.join(ROOT, "configs", "long_chains.py")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=100, help="policy versions of the RL arm (default 100)")
  p.add_argument("--seeds", type=int, default=1, help="seeds per arm (default 1)")
  p.add_argument("--workdir", default="", help="keep the runs here; a rerun reuses finished arms")
  p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
  p.add_argument("--override", action="append", default=[], help="extra --config.x=y for every arm")
  p.add_argument("--rl-override", action="append", default=[], help="extra --config.x=y for RL only")
  args = p.parse_args(argv)
  work = args.workdir or tempfile.mkdtemp(prefix="rl_vs_rft_")
  os.makedirs(work, exist_ok=True)
  py, t0 = sys.executable, time.time()
  data = os.path.join(work, "data")
  ws_dir = os.path.join(work, "ws")
  ws = os.path.join(ws_dir, "warm_start")
  if not os.path.exists(os.path.join(ws_dir, "sft_summary.json")):
    print(f"[rl_vs_rft] warm start on short demonstrations in {work}", flush=True)
    run_logged([py, "-m", "asyncrl_jax.sft", f"--config={CONFIG}", f"--workdir={ws_dir}",
                f"--config.data.path={data}", "--evaluate", *args.override], os.path.join(work, "ws.log"))
  warm = read_json(os.path.join(ws_dir, "sft_summary.json"))
  common = [f"--config={CONFIG}", f"--config.model.hf_path={ws}", f"--config.data.path={data}", *args.override]
  rows_by_arm = {"rl": [], "rft": [], "sft_short": []}
  for seed in range(args.seeds):
    name = f"rl_seed{seed}"
    wd = os.path.join(work, name)
    print(f"[rl_vs_rft] {name} ({time.time() - t0:.0f}s so far)", flush=True)
    if not os.path.exists(os.path.join(wd, "summary.json")):
      run_logged([py, "-m", "asyncrl_jax.train", *common, f"--workdir={wd}", f"--config.seed={seed}",
                  f"--config.steps={args.steps}", f"--config.learner.eval_every={max(1, args.steps // 4)}",
                  f"--config.checkpoint.every_steps={args.steps}", *args.rl_override],
                 os.path.join(work, f"{name}.log"))
    s = read_json(os.path.join(wd, "summary.json"))
    if s["steps"] != args.steps:
      raise SystemExit(f"{wd} holds a run of {s['steps']} versions, not {args.steps}: use another --workdir")
    budget = s["rl_seconds_this_run"]
    rows_by_arm["rl"].append(dict(seed=seed, seconds=budget, steps=s["steps"], final=s["final_eval_accuracy"],
                                  final_greedy=s["final_eval_greedy_accuracy"],
                                  final_se=s.get("final_eval_accuracy_se"),
                                  evaluation=f"{s.get('final_eval_metric')}, {s.get('final_eval_problems')} problems"))
    for arm, flags in (("rft", ["--rft"]), ("sft_short", ["--schedule=constant"])):
      cd = os.path.join(work, f"{arm}_seed{seed}")
      print(f"[rl_vs_rft] {arm} seed {seed}: {budget:.0f}s ({time.time() - t0:.0f}s so far)", flush=True)
      if not os.path.exists(os.path.join(cd, "sft_summary.json")):
        run_logged([py, "-m", "asyncrl_jax.sft", *common, f"--workdir={cd}", f"--config.seed={seed}",
                    "--config.learner.warm_start_steps=1000000", f"--max_seconds={budget}", "--evaluate",
                    *flags], os.path.join(work, f"{arm}{seed}.log"))
      c = read_json(os.path.join(cd, "sft_summary.json"))
      rows_by_arm[arm].append(dict(seed=seed, seconds=c["seconds"], steps=c["steps"],
                                   final=c["final_eval_accuracy"], final_greedy=c["final_eval_greedy_accuracy"],
                                   final_se=c.get("final_eval_accuracy_se"),
                                   evaluation=f"{c.get('eval_metric')}, {c.get('eval_problems')} problems",
                                   **({"rft": c["rft"]} if "rft" in c else {})))
  header = ["arm", "seeds", "held-out pass@1 (5-10 terms)", "SE", "greedy", "seconds", "optimizer steps"]
  se = lambda runs: (f"{100 * np.mean([r['final_se'] for r in runs]):.2f}"
                     if runs and all(r.get("final_se") is not None for r in runs) else "-")
  rows = [["warm start (demonstrations of 2-4 terms)", 1, percent_cell([warm["final_eval_accuracy"]]), "-",
           percent_cell([warm["final_eval_greedy_accuracy"]]), f"{warm['seconds']:.0f}", warm["steps"]]]
  for arm, runs in rows_by_arm.items():
    rows.append([arm, len(runs), percent_cell([r["final"] for r in runs]), se(runs),
                 percent_cell([r["final_greedy"] for r in runs]),
                 f"{np.mean([r['seconds'] for r in runs]):.0f}", f"{np.mean([r['steps'] for r in runs]):.0f}"])
  evaluations = sorted({r["evaluation"] for runs in rows_by_arm.values() for r in runs})
  if len(evaluations) > 1:
    raise SystemExit(f"the arms were evaluated differently ({'; '.join(evaluations)}): rerun them in a fresh "
                     "--workdir")
  rl, rft = np.mean([r["final"] for r in rows_by_arm["rl"]]), np.mean([r["final"] for r in rows_by_arm["rft"]])
  kept = [r["rft"] for r in rows_by_arm["rft"]]
  notes = (f"configs/long_chains.py: warm start on worked solutions of 2-4-term chains only; RL prompts and "
           f"held-out problems of 5-10 terms (no demonstration). `rl`: the main job for {args.steps} "
           f"versions{' with ' + ' '.join(args.rl_override) if args.rl_override else ''}; `rft`: "
           "rejection-sampling fine-tuning on the model's own correct samples of the same prompts "
           "(`python -m asyncrl_jax.sft --rft`), `sft_short`: more training on the short demonstrations, "
           "each for the RL arm's wall time (its RL phase and final evaluation). Held-out pass@1 in % "
           f"({evaluations[0]}, every arm; SE: the runs' mean standard error over problems). "
           f"RL {'matches or beats' if rl >= rft else 'stays below'} the rejection-sampling control: "
           f"{100 * rl:.1f} vs {100 * rft:.1f}. RFT kept {np.mean([k['kept'] for k in kept]):.0f} of "
           f"{np.mean([k['sampled'] for k in kept]):.0f} samples over "
           f"{np.mean([k['rounds'] for k in kept]):.0f} rounds. A rerun with the same --workdir reuses "
           "finished arms.")
  result = dict(machine=machine(), config=dict(config=os.path.relpath(CONFIG, ROOT), steps=args.steps,
                                               seeds=args.seeds, overrides=args.override,
                                               rl_overrides=args.rl_override),
                warm_start=warm, arms=rows_by_arm, seconds=time.time() - t0)
  md = write_result("rl_vs_rft", result, header, rows, notes, **({"out_dir": args.out} if args.out else {}))
  print(f"[rl_vs_rft] wrote {md}")
  print(json.dumps({"warm_start": warm["final_eval_accuracy"], **{arm: float(np.mean([r["final"] for r in runs]))
                                                                   for arm, runs in rows_by_arm.items()}}))
  return 0


if __name__ == "__main__":
  sys.exit(main())

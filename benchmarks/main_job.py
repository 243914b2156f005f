"""The README's main job as a record: its command as written, at 3 seeds, each with its own warm start.

  nice -n 19 .venv/bin/python benchmarks/main_job.py --workdir DIR     # runs the missing seeds
  .venv/bin/python benchmarks/main_job.py --assemble-only              # the table from the records

Seed S runs ``python -m asyncrl_jax.train --config=configs/default.py --workdir=DIR/CODE/seedS
--config.seed=S`` (CODE: the training code's commit) (the README's command, plus the seed from 1 on: seed 0 is the command exactly). The
supervised warm start is part of the job, so each seed has its own. Each finished seed's record is
kept in ``benchmarks/results/main_job_runs/seedS.json``: the figures of its ``summary.json`` (held-out
pass@1 and greedy accuracy of the warm start and of the last version, all 500 held-out problems, with
their standard errors; the staleness reached against the bound; versions; the warm start's and the
whole job's seconds), the training-code commit it ran (``asyncrl_jax/``, ``configs/``) and the
machine. A rerun runs only the seeds without a record at the current training code; the table
refuses records of more than one training-code commit (decision 0041), so a change to the training
code means running the seeds again.

Writes benchmarks/results/main_job.{json,md}: each seed, and the range over seeds (min-max) of every
figure, which the README's quick start quotes. About 5-15 minutes a seed on 2 cores (more on a
loaded or slower machine; each seed's wall time is in its record).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402  pylint: disable=wrong-import-position

NAME = "main_job"
RUNS = os.path.join(common.RESULTS_DIR, f"{NAME}_runs")
COMMAND = ["-m", "asyncrl_jax.train", "--config=configs/default.py"]
# (record key, summary.json key, label): the figures the README quotes
FIGURES = (("initial", "initial_final_eval_accuracy", "pass@1 after the warm start"),
           ("final", "final_eval_accuracy", "pass@1 after RL"),
           ("initial_greedy", "initial_final_eval_greedy_accuracy", "greedy after the warm start"),
           ("final_greedy", "final_eval_greedy_accuracy", "greedy after RL"))


def record_of(summary: dict, seed: int, code: str, machine: dict) -> dict:
  """A seed's record from its run's ``summary.json``; raises naming the field a run did not write."""
  missing = [s for _, s, _ in FIGURES if summary.get(s) is None]
  if missing:
    raise ValueError(f"seed {seed}: summary.json has no {missing} (did the run finish its last evaluation?)")
  out = {key: float(summary[s]) for key, s, _ in FIGURES}
  out.update(seed=seed, code_commit=code, machine=machine, versions=summary.get("steps"),
             final_se=summary.get("final_eval_accuracy_se"),
             final_greedy_se=summary.get("final_eval_greedy_accuracy_se"),
             problems=summary.get("final_eval_problems"),
             max_staleness_seen=summary.get("max_staleness_seen"), max_staleness=summary.get("max_staleness"),
             warm_start_seconds=summary.get("warm_start_seconds"), wall_seconds=summary.get("wall_seconds"))
  return out


def run_seed(seed: int, workdir: str, code: str) -> dict:
  """Runs (or resumes: a killed job resumes from its checkpoint) one seed's job at training code
  ``code`` (in ``workdir/code/seedS``, so that a finished run of other code is never resumed) and
  returns its record."""
  import subprocess  # pylint: disable=import-outside-toplevel
  run = os.path.join(os.path.abspath(workdir), code, f"seed{seed}")
  cmd = [sys.executable, *COMMAND, f"--workdir={run}"] + ([f"--config.seed={seed}"] if seed else [])
  print(f"[{NAME}] seed {seed}: {' '.join(cmd[1:])}", flush=True)
  started = time.time()
  proc = subprocess.run(cmd, cwd=ROOT, check=False)
  if proc.returncode:
    raise SystemExit(f"[{NAME}] seed {seed} exited with {proc.returncode} (its workdir: {run})")
  record = record_of(common.read_json(os.path.join(run, "summary.json")), seed, code, common.machine())
  record["seconds_this_call"] = time.time() - started
  return record


def records() -> list[dict]:
  if not os.path.isdir(RUNS):
    return []
  return sorted((common.read_json(os.path.join(RUNS, f)) for f in os.listdir(RUNS) if f.endswith(".json")),
                key=lambda r: r["seed"])


def assemble(runs: list[dict], out_dir: str = common.RESULTS_DIR) -> str:
  """main_job.{json,md}: each seed and the range of each figure over seeds."""
  if not runs:
    raise SystemExit(f"no seed has a record in {RUNS}: run some first (--workdir)")
  codes = sorted({r["code_commit"] for r in runs})
  if len(codes) > 1:
    raise SystemExit(f"the records ran different training code ({', '.join(codes)}): a range over them "
                     "would mix two programs (decision 0041); run the seeds again at one commit")
  ranges = {key: [min(r[key] for r in runs), max(r[key] for r in runs)] for key, _, _ in FIGURES}
  minutes = [r["wall_seconds"] / 60 for r in runs if r.get("wall_seconds")]
  result = {"machine": common.machine(), "code_commit": codes[0], "seeds": [r["seed"] for r in runs],
            "command": " ".join(["python", *COMMAND, "--workdir=DIR"]), "ranges": ranges,
            "minutes": [min(minutes), max(minutes)] if minutes else None, "runs": runs}
  header = ["seed", *[label for _, _, label in FIGURES], "max staleness seen / allowed", "versions", "minutes"]
  rows = [[r["seed"], *[f"{r[key]:.3f}" for key, _, _ in FIGURES],
           f"{r['max_staleness_seen']} / {r['max_staleness']}", r["versions"],
           f"{r['wall_seconds'] / 60:.1f}" if r.get("wall_seconds") else "-"] for r in runs]
  rows.append(["range", *[f"{lo:.2f}-{hi:.2f}" for lo, hi in (ranges[key] for key, _, _ in FIGURES)], "", "",
               f"{result['minutes'][0]:.0f}-{result['minutes'][1]:.0f}" if minutes else "-"])
  notes = (f"The README's main job (`{result['command']}`, seed S as `--config.seed=S`), each seed with its "
           f"own warm start, training code {codes[0]}. Held-out figures on all 500 held-out problems "
           "(pass@1: 4 samples at temperature 1). Minutes: the whole job, warm start and evaluations "
           "included, on the machine each record names.")
  md = common.write_result(NAME, result, header, rows, notes, out_dir=out_dir)
  print(f"[{NAME}] wrote {md}")
  return md


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", default="", help="the seeds' run directories (DIR/CODE/seedS)")
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--assemble-only", action="store_true")
  args = p.parse_args(argv)
  if not args.assemble_only:
    if not args.workdir:
      raise SystemExit("--workdir is needed to run seeds (or --assemble-only)")
    code = common.code_commit()
    if code.endswith("+changes"):
      raise SystemExit("the training code has uncommitted changes: a record must name the code it ran; commit first")
    have = {r["seed"] for r in records() if r["code_commit"] == code}
    os.makedirs(RUNS, exist_ok=True)
    for seed in range(args.seeds):
      if seed in have:
        print(f"[{NAME}] seed {seed}: recorded at {code}", flush=True)
        continue
      record = run_seed(seed, args.workdir, code)
      with open(os.path.join(RUNS, f"seed{seed}.json"), "w") as f:
        json.dump(record, f, indent=2)
  runs = [r for r in records() if args.assemble_only or r["code_commit"] == common.code_commit()]
  if not runs:  # (run_all's assembly before any seed ran: nothing to write)
    print(f"[{NAME}] no seed has a record in {RUNS} yet: run them with --workdir DIR")
    return 0
  assemble(runs)
  return 0


if __name__ == "__main__":
  sys.exit(main())

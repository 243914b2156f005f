"""CPU speed of two commits side by side: the fixed-workload benchmarks of each, interleaved.

  .venv/bin/python benchmarks/code_ab.py --base 3b19c27 [--head HEAD] [--rounds 3]

A change must not make the main job slower on CPU. Timing the main job itself does not show that: from
an untrained policy two codes' runs follow different paths and generate different lengths, so tokens
per second differ for reasons that are not speed. This runs benchmarks whose work is fixed by their
arguments (``engine_throughput --quick``: the decode server and the bare fused decode loop on the
default model; ``learner_throughput --quick``: the learner's update) in a detached worktree of each
commit (this checkout's ``.venv``), alternating base and head each round so both see the same machine
state, and reports head / base per metric (median over rounds, and the spread of the per-round
ratios). Run it alone on the machine: anything beside it moves both arms, unevenly.
Writes benchmarks/results/code_ab.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import machine, write_result  # noqa: E402  pylint: disable=wrong-import-position

# benchmark -> the metrics of its JSON result compared (higher is faster)
METRICS = {
    "engine_throughput": ("engine_tok_s", "reference_tok_s"),
    "learner_throughput": ("policy_tokens_per_s",),
}
LABELS = {"engine_tok_s": "decode server, tokens/s", "reference_tok_s": "fused decode loop, tokens/s",
          "policy_tokens_per_s": "learner update, policy tokens/s"}


def _git(*args: str) -> str:
  return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def _worktree(commit: str, parent: str, side: str) -> str:
  path = os.path.join(parent, side)
  subprocess.run(["git", "worktree", "add", "--detach", path, commit], cwd=ROOT, check=True,
                 capture_output=True)
  return path


def _run(tree: str, bench: str, out: str) -> dict:
  """One benchmark in one worktree; its JSON result (written under ``out``, not the tree's results)."""
  env = dict(os.environ, PYTHONPATH=tree)
  cmd = [sys.executable, os.path.join(tree, "benchmarks", f"{bench}.py"), "--quick", "--out", out]
  proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
  if proc.returncode:
    raise RuntimeError(f"{bench} failed in {tree} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
  with open(os.path.join(out, f"{bench}.json")) as f:
    return json.load(f)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--base", required=True, help="the commit to compare against")
  p.add_argument("--head", default="HEAD")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--benchmarks", nargs="+", default=list(METRICS), choices=list(METRICS))
  p.add_argument("--name", default="code_ab")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  commits = {"base": _git("rev-parse", "--short", args.base), "head": _git("rev-parse", "--short", args.head)}
  runs = {side: {m: [] for b in args.benchmarks for m in METRICS[b]} for side in commits}
  with tempfile.TemporaryDirectory(prefix="code_ab_") as tmp:
    trees = {side: _worktree(c, tmp, side) for side, c in commits.items()}
    try:
      for r in range(args.rounds):
        order = ("base", "head") if r % 2 == 0 else ("head", "base")
        for bench in args.benchmarks:
          for side in order:
            out = os.path.join(tmp, f"out_{side}_{bench}_{r}")
            result = _run(trees[side], bench, out)
            for m in METRICS[bench]:
              runs[side][m].append(float(result[m]))
            print(f"[code_ab] round {r + 1}/{args.rounds} {bench} {side} ({commits[side]}): "
                  + ", ".join(f"{m}={result[m]:,.0f}" for m in METRICS[bench]), flush=True)
    finally:
      for tree in trees.values():
        subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, check=False,
                       capture_output=True)
  metrics = {}
  for m in runs["base"]:
    base, head = np.asarray(runs["base"][m]), np.asarray(runs["head"][m])
    ratios = head / base
    metrics[m] = dict(base=float(np.median(base)), head=float(np.median(head)),
                      ratio=float(np.median(head) / np.median(base)),
                      round_ratios=[float(x) for x in ratios], base_runs=base.tolist(), head_runs=head.tolist())
  result = {"benchmark": "code_ab", "commits": commits, "metrics": metrics, "machine": machine(),
            "config": {"rounds": args.rounds, "benchmarks": args.benchmarks, "arguments": "--quick",
                       "base": commits["base"], "head": commits["head"]}}
  rows = [[LABELS[m], f"{v['base']:,.0f}", f"{v['head']:,.0f}", f"{v['ratio']:.3f}",
           f"{min(v['round_ratios']):.2f}-{max(v['round_ratios']):.2f}"] for m, v in metrics.items()]
  notes = (f"CPU speed of {commits['head']} (head) against {commits['base']} (base) on fixed workloads "
           f"({', '.join(args.benchmarks)}, `--quick`), {args.rounds} interleaved rounds; ratio = "
           f"head / base of the medians (> 1: head faster), and the range of the per-round ratios.")
  kwargs = {"out_dir": args.out} if args.out else {}
  path = write_result(args.name, result, ["metric", "base", "head", "head / base", "per round"], rows,
                      notes, **kwargs)
  print(json.dumps({m: round(v["ratio"], 3) for m, v in metrics.items()}))
  print(f"[code_ab] wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

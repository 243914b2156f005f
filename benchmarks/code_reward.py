"""The code reward's throughput on this machine: programs scored per second, and one version's batch.

  .venv/bin/python benchmarks/code_reward.py [--quick]

Programs of the built-in code task (``data.code_functions``: 7 tests each, the 3 shown and 4 hidden),
each run in its own sandbox start (``rl.rewards.code_reward``), scored by 1, 2, 4 and 8 reward threads
at once (the reward worker's threads, ``rl.reward_threads``: default 2, ``configs/code.py`` 8):

* **distinct programs**: every program different (no cache hit), half right and half wrong (a wrong
  program stops at its first failing test): programs per second, and seconds per program;
* **one version's batch**: ``configs/code.py``'s batch (128 completions, groups of 8) through
  ``CodeReward`` on a ``RewardWorker``, as a run scores it (the cache: a group's repeated program
  runs once, its repeats called back without holding a thread), with ``--distinct`` different
  programs per group (8: a policy that never repeats itself; 1: one that always does): seconds to
  score the batch.

The learner's actual wait on the reward is measured in a run (``metrics.jsonl``:
``reward_wait_seconds`` against ``batch_wait_seconds`` and the version's time); this benchmark gives
the reward's own rate beside it.

Writes benchmarks/results/code_reward.{json,md} (``--quick``: code_reward_quick, a structure check whose
figures mean little); prints one JSON object (last line).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402  pylint: disable=wrong-import-position

from asyncrl_jax.data import code_functions  # noqa: E402
from asyncrl_jax.envs import sandbox  # noqa: E402
from asyncrl_jax.rl.rewards import CodeReward, RewardWorker, code_reward  # noqa: E402
from benchmarks import common  # noqa: E402

BATCH, GROUP = 128, 8


def _programs(n: int, seed: int) -> list:
  """``(completion, tests)`` of ``n`` problems: the worked solution for even i, a wrong one for odd."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    p = code_functions.make_problem(rng)
    text = p.solution if i % 2 == 0 else p.solution.replace("*x", "*x+1")
    out.append((text, p.answer))
  return out


def distinct_rate(n: int, threads: int, seed: int) -> dict:
  items = _programs(n, seed)
  t = time.perf_counter()
  with cf.ThreadPoolExecutor(threads) as pool:
    scores = list(pool.map(lambda it: code_reward(*it), items))
  seconds = time.perf_counter() - t
  assert scores == [1.0 if i % 2 == 0 else 0.0 for i in range(n)], "a worked solution failed or a wrong one passed"
  return {"programs": n, "threads": threads, "seconds": seconds, "programs_per_s": n / seconds,
          "ms_per_program": 1000 * seconds / n}


def batch_seconds(distinct: int, threads: int, seed: int) -> dict:
  """One version's batch: BATCH / GROUP problems, each group's GROUP completions drawn from
  ``distinct`` different programs."""
  rng = np.random.default_rng(seed)
  items = []
  for _ in range(BATCH // GROUP):
    p = code_functions.make_problem(rng)
    variants = [p.solution] + [p.solution.replace("*x", f"*x+{k}") for k in range(1, distinct)]
    items += [(variants[j % distinct], p.answer) for j in range(GROUP)]
  reward = CodeReward()
  scored = threading.Semaphore(0)
  worker = RewardWorker(reward, lambda item, r: scored.release(), threads=threads)  # as a run scores
  t = time.perf_counter()
  for i, (completion, tests) in enumerate(items):
    worker.submit(i, completion, tests)
  for _ in items:
    scored.acquire()
  seconds = time.perf_counter() - t
  worker.close()
  return {"completions": len(items), "distinct_per_group": distinct, "threads": threads,
          "sandbox_runs": reward.runs, "seconds": seconds}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="few programs (structure only)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  ok, why = sandbox.available()
  if not ok:
    raise SystemExit(f"the sandbox cannot run here: {why}")
  n = 8 if args.quick else 96
  code_reward(*_programs(1, args.seed)[0])  # (the first start reads the interpreter's layout)
  load_before = os.getloadavg()[0]
  rates = [distinct_rate(n, threads, args.seed) for threads in (1, 2, 4, 8)]
  batches = [batch_seconds(d, t, args.seed + 1) for d in ((8, 1) if not args.quick else (2,)) for t in (2, 8)]
  result = {"machine": common.machine(), "commit": common.code_commit(), "quick": args.quick,
            "distinct": rates, "batch": batches,
            # (other work on the machine slows the sandbox starts: the 1-minute load average)
            "load_average": [load_before, os.getloadavg()[0]]}
  rows = [[f"{r['threads']} thread(s)", r["programs"], f"{r['programs_per_s']:.1f}", f"{r['ms_per_program']:.0f}"]
          for r in rates]
  rows += [[f"one batch ({b['completions']} completions, {b['distinct_per_group']} distinct per group, "
            f"{b['threads']} threads)", b["sandbox_runs"], "", f"{1000 * b['seconds']:.0f} in all"] for b in batches]
  common.write_result("code_reward_quick" if args.quick else "code_reward", result, ["scoring", "sandbox runs", "programs / s", "ms per program"], rows,
                      notes=__doc__.split("\n\n", 2)[1] + "\n\nCommit " + result["commit"] + "; 1-minute load "
                      f"average {result['load_average'][0]:.1f} before, {result['load_average'][1]:.1f} after "
                      "(other work on the machine slows the sandbox starts).")
  print(json.dumps(result))


if __name__ == "__main__":
  main()

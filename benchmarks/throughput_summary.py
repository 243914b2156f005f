"""The three speed claims on the seed's length shape, ours beside the seed's and AReaL's figures.

  .venv/bin/python benchmarks/throughput_summary.py

Reads results/async_vs_sync_lognormal.json (``async_vs_sync.py --workload lognormal``, full run) and
results/packing_lognormal.json (``packing.py --median 32 --sigma 1.15 --cap 640 --name
packing_lognormal``) and writes results/throughput_summary.{json,md}: one row per claim, each with
the figure it is compared with. Measures nothing itself; each row names the run it comes from.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import RESULTS_DIR, read_json, write_result  # noqa: E402  pylint: disable=wrong-import-position

# The seed's and AReaL's figures (../shared/seeds): free-training headroom of synchronous RL on
# lognormal(7.4, 1.15) capped at 32k, and AReaL's end-to-end and component gains.
SEED_HEADROOM = 2.62
AREAL_ETA2 = 2.77
AREAL_PACKING = "+33.7% (17-43%)"
AREAL_INTERRUPT = "+12-17%"


def _pct(x) -> str:
  return "-" if x is None else f"{100 * x:+.1f}%"


def summary_rows(avs: dict, packing: dict | None) -> list:
  arms = avs["arms"]
  eta2 = arms["2"]
  rows = [
      ["free-training headroom (simulator, same lengths, slots, batch)", f"{avs['predicted_headroom']:.2f}x",
       f"{SEED_HEADROOM:.2f}x (seed, 32k cap)", "-"],
      ["async eta 2 / colocated sync, trained tok/s", f"{avs['ratio']:.2f}x",
       f"{AREAL_ETA2:.2f}x (AReaL, 1.5B, eta 2 / eta 0)",
       f"planner {avs['predicted_ratio']:.2f}x (measured / predicted {avs['ratio_over_predicted']:.2f})"],
      ["decode-slot utilization, colocated sync -> eta 2",
       f"{arms['colocated sync']['slot_utilization']:.1%} -> {eta2['slot_utilization']:.1%}",
       "38.1% synchronous (seed's simulation, free training)",
       f"planner {eta2['predicted']['slot_utilization']:.1%}; learner-bound: "
       f"{'yes' if avs['predicted']['learner_bound'] else 'no'}"],
  ]
  for eta in ("4", "8"):
    if eta in arms:
      rows.append([f"async eta {eta} / colocated sync", f"{arms[eta]['ratio_vs_colocated']:.2f}x", "-",
                   f"slot utilization {arms[eta]['slot_utilization']:.1%}"])
  if packing is not None:
    rows.append(["token-budget packing vs padded micro-batches (learner tok/s)",
                 _pct(packing["mean_ratio"] - 1), f"{AREAL_PACKING} (AReaL)",
                 f"{packing['config']['batch']} sequences, cap {packing['config']['cap']}; padded "
                 f"micro-batches of {packing['config']['rows']} sequences fill "
                 f"{sum(r['padded_fill'] for r in packing['runs']) / len(packing['runs']):.0%} of their "
                 "tokens"])
  for mode, what in (("drain", "interruptible vs drain-then-switch"), ("keep_cache", "re-prefill vs keep_cache")):
    if f"interrupt_gain_vs_{mode}" in avs:
      rows.append([f"{what} at eta 2, trained tok/s", _pct(avs[f"interrupt_gain_vs_{mode}"]),
                   f"{AREAL_INTERRUPT} (AReaL, vs non-interruptible)" if mode == "drain" else "-",
                   f"generated tok/s {_pct(avs[f'generation_gain_vs_{mode}'])}; mean staleness "
                   f"{arms['2']['mean_staleness']:.2f} vs {arms[f'2 {mode}']['mean_staleness']:.2f}"])
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--results", default=RESULTS_DIR, help="where the two result files are")
  p.add_argument("--out", default=None, help="results directory (default: --results)")
  args = p.parse_args(argv)
  path = os.path.join(args.results, "async_vs_sync_lognormal.json")
  if not os.path.exists(path):
    raise SystemExit(f"{path} is missing: run benchmarks/async_vs_sync.py --workload lognormal first")
  avs = read_json(path)
  packing_path = os.path.join(args.results, "packing_lognormal.json")
  packing = read_json(packing_path) if os.path.exists(packing_path) else None
  rows = summary_rows(avs, packing)
  notes = (f"Workload `{avs['workload']}` ({avs['config']['slots']} decode slots, batch "
           f"{avs['config']['batch']}, {len(avs['config']['cores'])} CPU cores; the rows come from "
           f"async_vs_sync_lognormal, commit {avs['machine']['commit']}, {avs['machine']['date']}"
           + (f", and packing_lognormal, commit {packing['machine']['commit']}" if packing else
              "; packing_lognormal not run") + "). The seed's and AReaL's figures are for 1.5B models "
           "on accelerators with a 32k cap: the comparison is of shape, not of scale.")
  write_result("throughput_summary", dict(machine=avs["machine"], rows=rows, config=avs["config"],
                                          sources=["async_vs_sync_lognormal"] + (["packing_lognormal"]
                                                                                 if packing else [])),
               ["claim", "ours", "seed / AReaL", "beside it"], rows, notes, out_dir=args.out or args.results)
  return 0


if __name__ == "__main__":
  sys.exit(main())

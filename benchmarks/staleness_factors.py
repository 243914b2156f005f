"""What makes decoupled PPO's eta-8 gap: one factor at a time from the pinned grid's regime.

  nice -n 19 .venv/bin/python benchmarks/staleness_factors.py --factor base --seeds 5 --workdir=DIR
  .venv/bin/python benchmarks/staleness_factors.py --assemble-only

Each factor (``FACTORS``) is decoupled PPO on exact staleness (``rl.staleness_mode=pinned``) at eta 0
and 8, in the regime of ``staleness_ablation_pinned`` (learning rate 3e-4, 2 optimizer updates per
version, 40 versions) with one change, run by ``staleness_ablation.py`` with ``--final-eval 500x16``
(each arm's last version on 500 held-out problems x 16 samples) under the name
``staleness_factor_NAME``: its arm records (``benchmarks/results/staleness_factor_NAME_arms/``) are
kept and committed, and a rerun with more ``--seeds`` runs only the missing cells. Factor (e),
``behav``, changes the objective to plain PPO on the behaviour ratio, which at eta 0 is the same update
as decoupled PPO, so it runs eta 8 only and shares the reference's eta-0 cell.

``--assemble-only`` reads every factor's records and writes benchmarks/results/staleness_factors.{json,md}:
per factor the gap (eta-0 minus eta-8 pass@1, in points) with a Welch 98% interval (the screen's
level: docs/staleness.md), its effect against the reference's gap, the stopping rule's verdict
against the 1.5-point target, the seeds and the commits of every arm. A gap whose cells, or an effect
whose factor and reference, ran different training code (``code_commit``) is refused and says so
(decision 0041): rerun the reference (``--factor base``) at the factors' code to compare them.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import machine, read_json, write_result  # noqa: E402  pylint: disable=wrong-import-position

TARGET = 1.5  # points: the gap the shipped recipe must stay within at eta 8
LEVEL = 0.98  # the screen's interval (four looks at 5, 8, 12, 16 seeds: docs/staleness.md)
# name -> (what changes, extra staleness_ablation arguments, steps, arm, etas, eta-0 cell from)
FACTORS = {
    "base": ("the pinned grid's regime (reference)", [], 40, "decoupled_ppo", (0, 8), None),
    "v80": ("(a) 80 versions instead of 40", [], 80, "decoupled_ppo", (0, 8), None),
    "token_mean": ("(b) token-mean loss aggregation", ["--config.rl.aggregation=token_mean"], 40,
                   "decoupled_ppo", (0, 8), None),
    "std": ("(c) advantages scaled by the group's std", ["--config.rl.scale_by_std=True"], 40,
            "decoupled_ppo", (0, 8), None),
    "clip04": ("(d) clip 0.4", ["--config.rl.eps_clip=0.4"], 40, "decoupled_ppo", (0, 8), None),
    "behav": ("(e) trust region at the behaviour policy (plain ppo)", [], 40, "ppo", (8,), "base"),
    "lr_half": ("(f) half the learning rate, twice the versions",
                ["--config.learner.learning_rate=1.5e-4"], 80, "decoupled_ppo", (0, 8), None),
    # (f) halved the gap (+3.0 against v80's +6.3 at the same 80 versions): a quarter of the rate
    "lr_quarter": ("(f') a quarter of the learning rate, four times the versions",
                   ["--config.learner.learning_rate=7.5e-5"], 160, "decoupled_ppo", (0, 8), None),
}


def _name(factor: str) -> str:
  return f"staleness_factor_{factor}"


def run(factor: str, seeds: int, workdir: str, first_seed: int = 0) -> int:
  """Runs (or completes) one factor's cells through ``staleness_ablation.main``."""
  from benchmarks import staleness_ablation  # pylint: disable=import-outside-toplevel
  _, extra, steps, arm, etas, _ = FACTORS[factor]
  argv = ["--staleness-mode=pinned", "--steps", str(steps), "--arms", arm, "--etas", *map(str, etas),
          "--seeds", str(seeds), "--first-seed", str(first_seed), "--final-eval", "500x16",
          "--name", _name(factor), "--workdir", workdir, *(f"--override={o}" for o in extra)]
  return staleness_ablation.main(argv)


def _records(out_dir: str, factor: str) -> list[dict]:
  path = os.path.join(out_dir, f"{_name(factor)}_arms")
  if not os.path.isdir(path):
    return []
  return [read_json(os.path.join(path, f)) for f in sorted(os.listdir(path)) if f.endswith(".json")]


def welch(a, b, level: float = LEVEL) -> dict:
  """mean(a) - mean(b) with its Welch interval at ``level`` (None without 2 values on each side)."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  out = {"diff": float(a.mean() - b.mean()) if a.size and b.size else None, "n": [int(a.size), int(b.size)]}
  if a.size < 2 or b.size < 2:
    return dict(out, low=None, high=None, se=None, df=None)
  va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
  se = float(np.sqrt(va + vb))
  df = float((va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1))) if va + vb > 0 else float(
      a.size + b.size - 2)
  half = float(stats.t.ppf(0.5 + level / 2, df)) * se
  return dict(out, low=out["diff"] - half, high=out["diff"] + half, se=se, df=df)


def verdict(gap: dict, target: float = TARGET) -> str:
  """The stopping rule on a gap's interval (points): wholly above the target, wholly below, or
  around it and narrow enough (half-width <= target); else open."""
  if gap["low"] is None:
    return "open (fewer than 2 seeds in a cell)"
  if gap["low"] > target:
    return "does not close the gap"
  if gap["high"] < target:
    return "closes the gap"
  if (gap["high"] - gap["low"]) / 2 <= target:
    return "consistent with the target"
  return "open"


def assemble(out_dir: str) -> dict:
  """Each factor's cells, gap, effect against the reference and verdict (points)."""
  cells = {}
  for factor, (_, _, _, arm, etas, _) in FACTORS.items():
    runs = sorted((r for r in _records(out_dir, factor) if r["arm"] == arm), key=lambda r: r["seed"])
    cells[factor] = {eta: [r for r in runs if r["eta"] == eta] for eta in etas}
  pts = lambda runs, key="final": [100 * r[key] for r in runs if r.get(key) is not None]
  factors = {}
  for factor, (label, extra, steps, arm, etas, eta0_from) in FACTORS.items():
    zero = cells[eta0_from][0] if eta0_from else cells[factor][0]
    eight = cells[factor][8]
    if not zero and not eight:
      continue
    codes = _codes(zero + eight)
    gap = welch(pts(zero), pts(eight))
    if len(codes) > 1:  # decision 0041: no difference of cells run on different training code
      gap = dict(gap, refused=f"its cells ran different training code ({', '.join(codes)})")
    entry = dict(label=label, overrides=extra, steps=steps, arm=arm, eta0_from=eta0_from or factor,
                 eta0=pts(zero), eta8=pts(eight), eta0_greedy=pts(zero, "final_greedy"),
                 eta8_greedy=pts(eight, "final_greedy"),
                 warm_start=pts(zero + eight, "initial"), warm_start_greedy=pts(zero + eight, "initial_greedy"),
                 seeds={"0": [r["seed"] for r in zero], "8": [r["seed"] for r in eight]},
                 eval_se=float(np.mean(pts(zero + eight, "final_se"))) if pts(zero + eight, "final_se") else None,
                 gap=gap, verdict=f"refused: {gap['refused']}" if "refused" in gap else verdict(gap),
                 commits=sorted({r.get("commit") for r in zero + eight}), code_commits=codes)
    if factor != "base" and "base" in factors:
      base = factors["base"]
      if codes != base["code_commits"]:
        entry["effect"] = {"diff": None, "refused": f"training code {', '.join(codes)} against the "
                                                    f"reference's {', '.join(base['code_commits'])}"}
      elif eta0_from == "base":  # the same eta-0 cell: the effect is the eta-8 difference alone
        entry["effect"] = welch(base["eta8"], pts(eight))
      elif gap["se"] is not None and base["gap"]["se"] is not None:
        # (gap - base gap) over four independent cells; df by Welch-Satterthwaite over the four
        entry["effect"] = _difference_of_gaps(pts(zero), pts(eight), base["eta0"], base["eta8"])
    factors[factor] = entry
  return factors


def _codes(runs) -> list:
  """The training-code commits of ``runs``' records (``code_commit``), sorted."""
  return sorted({str(r.get("code_commit")) for r in runs})


def _difference_of_gaps(a0, a8, b0, b8, level: float = LEVEL) -> dict:
  """(mean a0 - mean a8) - (mean b0 - mean b8) with a Welch-Satterthwaite interval at ``level``."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  groups = [np.asarray(x, np.float64) for x in (a0, a8, b0, b8)]
  v = [g.var(ddof=1) / g.size for g in groups]
  diff = float(groups[0].mean() - groups[1].mean() - groups[2].mean() + groups[3].mean())
  se = float(np.sqrt(sum(v)))
  df = float(sum(v) ** 2 / sum(x ** 2 / (g.size - 1) for x, g in zip(v, groups))) if sum(v) > 0 else 1.0
  half = float(stats.t.ppf(0.5 + level / 2, df)) * se
  return {"diff": diff, "low": diff - half, "high": diff + half, "se": se, "df": df,
          "n": [int(g.size) for g in groups]}


def _cell(values) -> str:
  if not values:
    return "-"
  if len(values) == 1:
    return f"{values[0]:.1f}"
  return f"{np.mean(values):.1f} +- {np.std(values, ddof=1):.1f}"


def _interval(x: dict | None) -> str:
  if x and x.get("refused"):
    return f"refused ({x['refused']})"
  if not x or x.get("diff") is None:
    return "-"
  if x["low"] is None:
    return f"{x['diff']:+.1f}"
  return f"{x['diff']:+.1f} [{x['low']:+.1f}, {x['high']:+.1f}]"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--factor", choices=list(FACTORS), help="run (or complete) this factor's cells")
  p.add_argument("--seeds", type=int, default=5, help="seeds per cell (default 5: the first look)")
  p.add_argument("--workdir", default="", help="the factor's runs (one directory per factor)")
  p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="results directory")
  p.add_argument("--assemble-only", action="store_true", help="write staleness_factors.{json,md} only")
  args = p.parse_args(argv)
  if not args.assemble_only:
    if not args.factor or not args.workdir:
      raise SystemExit("--factor and --workdir are needed to run a factor (or --assemble-only)")
    rc = run(args.factor, args.seeds, args.workdir)
    if rc:
      return rc
  factors = assemble(args.out)
  if not factors:
    raise SystemExit(f"no factor has a finished arm in {args.out}: run one first (--factor)")
  header = ["factor", "change", "versions", "seeds (eta 0 / 8)", "pass@1 eta 0", "pass@1 eta 8",
            f"gap, {LEVEL:.0%} interval", "effect on the gap vs reference", "greedy eta 0 / 8", "verdict",
            "training code"]
  rows = [[f, e["label"], e["steps"], f"{len(e['eta0'])} / {len(e['eta8'])}", _cell(e["eta0"]),
           _cell(e["eta8"]), _interval(e["gap"]), _interval(e.get("effect")),
           f"{_cell(e['eta0_greedy'])} / {_cell(e['eta8_greedy'])}", e["verdict"], ", ".join(e["code_commits"])]
          for f, e in factors.items()]
  missing = [f for f in FACTORS if f not in factors]
  notes = ("Decoupled PPO on exact staleness (pinned) at eta 0 and 8, the pinned grid's regime (learning "
           "rate 3e-4, 2 updates per version, 40 versions) with one change per factor; each arm's final "
           "evaluation is 500 held-out problems x 16 samples (T=1) and greedy on 500. Cells: mean +- sd of "
           f"pass@1 over seeds, in points. Gap: eta 0 minus eta 8, Welch {LEVEL:.0%} interval. Effect: the "
           "factor's gap minus the reference's (negative: a smaller gap); (e) shares the reference's "
           "eta-0 cell, so its effect is the eta-8 difference. Training code: the commits of the "
           "training code (asyncrl_jax/, configs/) the factor's cells ran; a gap or effect across "
           "different training code is refused (decision 0041), not computed. Verdict against the "
           f"{TARGET}-point target: the stopping rule of docs/staleness.md (phase 1 is a screen; a "
           "recipe is confirmed on fresh seeds)."
           + (f" Not run yet: {', '.join(missing)}." if missing else ""))
  # (each arm's record names its own commit and machine; this is where the table was assembled)
  result = dict(machine=machine(), config=dict(arm="decoupled_ppo", staleness_mode="pinned",
                                               final_eval="500x16", factors={f: v[1] for f, v in FACTORS.items()}),
                target_points=TARGET, level=LEVEL, factors=factors, missing=missing)
  md = write_result("staleness_factors", result, header, rows, notes, out_dir=args.out)
  print(f"[factors] wrote {md}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""The headline of docs/staleness.md (phase 2): does the shipped recipe hold its eta-0 accuracy under
exact staleness, and does the seeds' baseline collapse? Fresh seeds, one fixed plan, one analysis.

  nice -n 19 .venv/bin/python benchmarks/staleness_headline.py --workdir DIR      # runs, resumes
  .venv/bin/python benchmarks/staleness_headline.py --assemble-only               # tabulates

Cells, pinned staleness (``rl.staleness_mode=pinned``: every batch is decoded by the version exactly
eta behind the one it trains), in phase 1's regime (``REGIME``: lr 7.5e-5, 2 updates per version, 160
versions), seeds 100-107: each recipe (``RECIPES``: decoupled PPO, and decoupled PPO with the KL term
towards the starting policy, ``SHIPPED``) at eta 0, 4, 8 and 16, and its baseline (``ppo_recompute``:
PPO's ratio against the recomputed proximal policy, the behaviour policy ignored; with the recipe's
other settings, ``BASELINES``) at 4, 8 and 16; at eta 0 a baseline and its recipe are the same update,
so they share one cell. Arms run one seed at a time (a recipe's four, then its baseline's three), so a
sitting that stops leaves whole seeds; every arm's record is kept in benchmarks/results/NAME_arms/
(decoupled PPO's and its baseline's in staleness_headline_arms/, the KL recipe's and its baseline's
in staleness_headline_kl_arms/) and a rerun
runs only the missing ones (``staleness_ablation.py``'s records, checked against the grid and the
training code's commit).

``--assemble-only`` writes benchmarks/results/staleness_headline.{json,md}: every cell's final pass@1
(500 problems x 16 samples) with its mean standard error, and per recipe three claims, each at 95%:

* the recipe's gap (eta 0 minus eta 8, Welch interval) has its upper end at most ``TARGET`` (1.5);
* the baseline is more than ``BASELINE_MARGIN`` (10) points below the recipe at eta 8 (lower end);
* greedy accuracy minus the starting weights' (each arm's own evaluation of them on the same 500
  problems, ``data.initial_eval_final``) has mean >= 0 and lower end > -1.5, at eta 0 and at eta 8;

and the regime's condition, that RL gains at least ``MIN_GAIN`` (5) points of pass@1 over the warm
start at eta 0.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import machine, read_json, write_result  # noqa: E402  pylint: disable=wrong-import-position

NAME = "staleness_headline"
BASELINE = "ppo_recompute"
KL_COEF = 0.3
# The recipes: label -> (its records' name, overrides on top of REGIME). Both are decoupled PPO; the
# second adds the KL term towards the starting policy (rl.kl_coef, k3), which the greedy probes chose
# (docs/staleness.md, "During phase 2"). Each recipe's baseline is ppo_recompute with the recipe's
# overrides, in the recipe's records (BASELINES: recipe label -> the baseline's label).
RECIPES = {"decoupled_ppo": (NAME, []),
           "decoupled_ppo_kl": (NAME + "_kl", [f"--config.rl.kl_coef={KL_COEF}"])}
BASELINES = {"decoupled_ppo": BASELINE, "decoupled_ppo_kl": BASELINE + "_kl"}
SHIPPED = "decoupled_ppo_kl"
RECIPE_ETAS, BASELINE_ETAS = (0, 4, 8, 16), (4, 8, 16)  # (a baseline's eta 0 is its recipe's)
STEPS = 160
REGIME = ["--config.learner.learning_rate=7.5e-5"]  # on top of the pinned grid's regime
FIRST_SEED, SEEDS = 100, 8
TARGET, BASELINE_MARGIN, GREEDY_MARGIN, MIN_GAIN, LEVEL = 1.5, 10.0, 1.5, 5.0, 0.95


def _argv(arm: str, etas, seed: int, workdir: str, name: str, extra=()) -> list[str]:
  return ["--staleness-mode=pinned", "--steps", str(STEPS), "--arms", arm,
          "--etas", *map(str, etas), "--first-seed", str(seed), "--seeds", "1",
          "--final-eval", "500x16", "--name", name, "--workdir", workdir,
          *(f"--override={o}" for o in REGIME), *(f"--arm-override={o}" for o in extra)]


def plan(workdir: str, seeds, recipe: str = SHIPPED, baseline: bool = True) -> list[tuple[str, list[str]]]:
  """(what, staleness_ablation's argv) per seed: the recipe's four cells, then its baseline's
  three, with the recipe's overrides. Decoupled PPO without the KL term runs in WORKDIR, another
  recipe in WORKDIR/ITS_NAME (the arms' names repeat across recipes)."""
  name, extra = RECIPES[recipe]
  where = lambda n: workdir if n == NAME else os.path.join(workdir, n)
  out = []
  for seed in seeds:
    out.append((f"seed {seed}: {recipe} at eta {', '.join(map(str, RECIPE_ETAS))}",
                _argv("decoupled_ppo", RECIPE_ETAS, seed, where(name), name, extra)))
    if baseline:
      out.append((f"seed {seed}: {BASELINES[recipe]} at eta {', '.join(map(str, BASELINE_ETAS))}",
                  _argv(BASELINE, BASELINE_ETAS, seed, where(name), name, extra)))
  return out


def run(workdir: str, out_dir: str, seeds, recipe: str = SHIPPED, baseline: bool = True) -> None:
  """Every missing arm of ``seeds``, seed by seed; the table is assembled after each
  (``staleness_ablation`` writes its own under the records' name, which this replaces)."""
  from benchmarks import staleness_ablation  # pylint: disable=import-outside-toplevel
  for what, argv in plan(workdir, seeds, recipe, baseline):
    print(f"[headline] {what}", flush=True)
    staleness_ablation.main([*argv, "--out", out_dir])
    assemble(out_dir)


def _records(out_dir: str) -> list[dict]:
  """Every record, its ``arm`` relabelled with its recipe or that recipe's baseline (a recipe's
  records hold arms ``decoupled_ppo`` and ``ppo_recompute``)."""
  out = []
  for label, (name, _) in RECIPES.items():
    path = os.path.join(out_dir, f"{name}_arms")
    for f in sorted(os.listdir(path)) if os.path.isdir(path) else []:
      if f.endswith(".json"):
        r = read_json(os.path.join(path, f))
        out.append(dict(r, arm={"decoupled_ppo": label, BASELINE: BASELINES[label]}[r["arm"]]))
  return out


def t_interval(x, level: float = LEVEL) -> dict:
  """Mean of ``x`` with its one-sample t interval (None without 2 values)."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  x = np.asarray(x, np.float64)
  out = {"mean": float(x.mean()) if x.size else None, "n": int(x.size)}
  if x.size < 2:
    return dict(out, low=None, high=None)
  half = float(stats.t.ppf(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size))
  return dict(out, low=out["mean"] - half, high=out["mean"] + half)


def _claim(holds: bool, fails: bool) -> str:
  return "holds" if holds else "fails" if fails else "open"


def _cell(recs: list[dict], arm: str, eta: int) -> dict:
  runs = sorted((r for r in recs if r["eta"] == eta and r["arm"] == arm), key=lambda r: r["seed"])
  pts = lambda key="final": [100 * r[key] for r in runs if r.get(key) is not None]
  greedy_change = [100 * (r["final_greedy"] - r["initial_final_greedy"]) for r in runs
                   if r.get("initial_final_greedy") is not None]
  return dict(arm=arm, eta=eta, seeds=[r["seed"] for r in runs], final=pts(), final_se=pts("final_se"),
              greedy=pts("final_greedy"), start=pts("initial_final"),
              start_greedy=pts("initial_final_greedy"), greedy_change=t_interval(greedy_change),
              kl_behav=[r.get("kl_behav") for r in runs], kl_behav_prox=[r.get("kl_behav_prox") for r in runs],
              code_commits=sorted({str(r.get("code_commit")) for r in runs}))


def _claims(cells: dict, recipe: str) -> tuple[dict, dict, dict]:
  """A recipe's gaps to its eta 0, its lead over the baseline and its four claims."""
  from benchmarks.staleness_factors import welch  # pylint: disable=import-outside-toplevel
  zero = cells[f"{recipe}_eta0"]
  gaps = {eta: welch(zero["final"], cells[f"{recipe}_eta{eta}"]["final"], LEVEL) for eta in RECIPE_ETAS if eta}
  below = {eta: welch(cells[f"{recipe}_eta{eta}"]["final"], cells[f"{BASELINES[recipe]}_eta{eta}"]["final"], LEVEL)
           for eta in BASELINE_ETAS}
  gain = t_interval([f - s for f, s in zip(zero["final"], zero["start"])] if len(zero["start"]) == len(
      zero["final"]) else [])
  g8, b8 = gaps[8], below[8]
  greedy = {eta: cells[f"{recipe}_eta{eta}"]["greedy_change"] for eta in (0, 8)}
  claims = {
      "recipe_gap_at_eta8": dict(
          gap=g8, target=TARGET,
          verdict=_claim(g8["high"] is not None and g8["high"] <= TARGET,
                         g8["low"] is not None and g8["low"] > TARGET)),
      "baseline_below_at_eta8": dict(
          difference=b8, margin=BASELINE_MARGIN,
          verdict=_claim(b8["low"] is not None and b8["low"] > BASELINE_MARGIN,
                         b8["high"] is not None and b8["high"] <= BASELINE_MARGIN)),
      "greedy_not_below_start": dict(
          change=greedy, margin=GREEDY_MARGIN,
          verdict=_claim(all(g["low"] is not None and g["mean"] >= 0 and g["low"] > -GREEDY_MARGIN
                             for g in greedy.values()),
                         any(g["mean"] is not None and g["n"] > 1 and (g["mean"] < 0 or g["high"] <= -GREEDY_MARGIN)
                             for g in greedy.values()))),
      "regime_gain_at_eta0": dict(
          gain=gain, minimum=MIN_GAIN,
          verdict=_claim(gain["low"] is not None and gain["low"] >= MIN_GAIN,
                         gain["high"] is not None and gain["high"] < MIN_GAIN)),
  }
  return gaps, below, claims


def assemble(out_dir: str) -> dict:
  """The cells, every recipe's gaps and claims (points)."""
  recs = _records(out_dir)
  cells, rows = {}, []
  parts = [(arm, etas, recipe) for recipe in RECIPES
           for arm, etas in ((recipe, RECIPE_ETAS), (BASELINES[recipe], (0, *BASELINE_ETAS)))]
  for arm, etas, recipe in parts:
    for eta in etas:
      shared = arm != recipe and eta == 0  # (at eta 0 the baseline is its recipe's update)
      c = cells[f"{arm}_eta{eta}"] = dict(_cell(recs, recipe if shared else arm, eta), arm=arm,
                                          shared_with=recipe if shared else None)
      fin = np.asarray(c["final"])
      rows.append([arm + (f" (= {recipe})" if shared else ""), eta, len(c["seeds"]),
                   f"{fin.mean():.1f} +- {fin.std(ddof=1):.1f}" if fin.size > 1 else
                   (f"{fin.mean():.1f}" if fin.size else "-"),
                   f"{np.mean(c['final_se']):.2f}" if c["final_se"] else "-",
                   f"{np.mean(c['greedy']):.1f}" if c["greedy"] else "-",
                   _interval(c["greedy_change"]), ", ".join(c["code_commits"]) or "-"])
  gaps, below, claims = {}, {}, {}
  for recipe in RECIPES:
    gaps[recipe], below[recipe], claims[recipe] = _claims(cells, recipe)
  seeds_done = sorted({r["seed"] for r in recs})
  note = (f"Pinned staleness, {STEPS} versions, lr 7.5e-5, 2 updates per version, 256 trajectories per "
          f"version, seeds {FIRST_SEED}-{FIRST_SEED + SEEDS - 1} (recorded so far: "
          f"{', '.join(map(str, seeds_done)) or 'none'}). Recipes: decoupled PPO without and with the KL "
          f"term towards the starting policy (`{SHIPPED}`: rl.kl_coef={KL_COEF}, k3; the shipped one); "
          f"each against its baseline, {BASELINE} with the recipe's other settings (`{BASELINES[SHIPPED]}` "
          "with the term; a baseline's eta-0 cell is its recipe's: the same update there). Final pass@1: 500 "
          "held-out problems x 16 samples, mean +- sd over seeds, points; SE: the runs' mean standard error "
          "over problems. Greedy change: final greedy accuracy minus the starting weights' on the same 500 "
          "problems, mean [95% t interval]. Claims (95%), per recipe: its gap at eta 8 (eta 0 minus eta 8, "
          f"Welch) upper end <= {TARGET}; the baseline more than {BASELINE_MARGIN} below it at eta 8 (lower "
          f"end); greedy change mean >= 0 and lower end > -{GREEDY_MARGIN} at eta 0 and 8; and RL's gain over "
          f"the warm start at eta 0 at least {MIN_GAIN}.\n\n" + "\n\n".join(
              f"`{recipe}`:\n\n" + "\n".join(f"* **{k}**: {v['verdict']} ({_describe(k, v)})"
                                            for k, v in claims[recipe].items())
              + "\n\nAt every eta (points, Welch 95%): the gap to its eta 0: "
              + ", ".join(f"eta {e}: {_interval(g, 'diff')}" for e, g in gaps[recipe].items())
              + f"; minus the baseline " + ", ".join(f"eta {e}: {_interval(d, 'diff')}"
                                                     for e, d in below[recipe].items()) + "."
              for recipe in RECIPES))
  config = dict(recipes={k: dict(records=n, overrides=o, baseline=BASELINES[k]) for k, (n, o) in RECIPES.items()},
                shipped=SHIPPED, baseline=BASELINE, recipe_etas=list(RECIPE_ETAS), baseline_etas=list(BASELINE_ETAS),
                steps=STEPS, regime=REGIME, final_eval="500x16", staleness_mode="pinned",
                seeds=list(range(FIRST_SEED, FIRST_SEED + SEEDS)))
  result = dict(machine=machine(), config=config, seeds=seeds_done, cells=cells, gaps=gaps,
                baseline_below=below, claims=claims, note=note)
  write_result(NAME, result, ["arm", "eta", "seeds", "final pass@1", "SE", "greedy", "greedy change",
                              "code"], rows, notes=note, out_dir=out_dir)
  return result


def _interval(d: dict, key: str = "mean") -> str:
  if d.get(key) is None:
    return "-"
  return f"{d[key]:+.1f}" + (f" [{d['low']:+.1f}, {d['high']:+.1f}]" if d.get("low") is not None else "")


def _describe(name: str, claim: dict) -> str:
  if name == "recipe_gap_at_eta8":
    return f"gap {_interval(claim['gap'], 'diff')} against {TARGET}"
  if name == "baseline_below_at_eta8":
    return f"recipe minus baseline {_interval(claim['difference'], 'diff')} against {BASELINE_MARGIN}"
  if name == "greedy_not_below_start":
    return "; ".join(f"eta {eta}: {_interval(g)}" for eta, g in claim["change"].items())
  return f"gain {_interval(claim['gain'])} against {MIN_GAIN}"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", default="", help="the arms' work directories (required to run; a rerun resumes)")
  p.add_argument("--first-seed", type=int, default=FIRST_SEED)
  p.add_argument("--seeds", type=int, default=SEEDS)
  p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
  p.add_argument("--recipe", choices=list(RECIPES), default=SHIPPED,
                 help=f"which recipe's cells to run (default {SHIPPED}, the shipped one)")
  p.add_argument("--no-baseline", action="store_true", help="run the recipe's cells alone")
  p.add_argument("--assemble-only", action="store_true")
  args = p.parse_args(argv)
  if not args.assemble_only:
    if not args.workdir:
      raise SystemExit("--workdir is required to run the arms")
    run(args.workdir, args.out, range(args.first_seed, args.first_seed + args.seeds), args.recipe,
        not args.no_baseline)
  assemble(args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Held-out accuracy by objective and staleness bound, in a regime where staleness can hurt.

  .venv/bin/python benchmarks/staleness_ablation.py --staleness-mode=pinned --steps 40 --workdir=DIR
                                    # the grid on exact staleness (72 runs, about 4-5 hours on 2 cores)
  .venv/bin/python benchmarks/staleness_ablation.py --quick      # about 35 minutes on 2 cores
  .venv/bin/python benchmarks/staleness_ablation.py --workdir=/data/ablation   # the bounded grid

``--staleness-mode=pinned`` (``rl.staleness_mode=pinned``): every token trained at version v was
sampled by version max(0, v - eta), so eta is the staleness itself and no arm's learner speed changes
its data. Its arms (``PINNED_ARMS``): the seeds' naive baseline ``ppo_recompute`` (PPO with the old
log-probs recomputed before the update), ``ppo`` (PPO on the behaviour ratio), ``decoupled_ppo`` as
shipped, ``decoupled_ppo_cap5`` (AReaL's guard), ``dis`` and ``dis_sign_aware`` (the correction the
eta-8 probe ranked first), at eta 0, 4, 8 and 16; results NAME_pinned, with each arm against its own
eta 0 seed by seed, and per arm the ratio's quantiles and the masked tokens by the side of the ratio
and the sign of the advantage.

Every arm is the main job (``python -m asyncrl_jax.train``, configs/default.py) from one shared
supervised warm start, for the same number of policy versions on batches of the same number of
trajectories, in the regime ``GRID`` (learning rate 3e-4, 2 optimizer updates per batch: the policy
moves far within eta versions). Arms (``ARMS``): naive PPO, decoupled PPO (the default), DIS, and SAO
(one rollout per prompt, value advantages from the learner's critic, DIS), at eta in 0, 2, 4, 8, 16 and
unbounded (admission limited by the decode slots alone), 3 seeds; ``--quick``: eta 0 (naive PPO only,
the synchronous reference) and 16 (every arm), one seed, 60 versions.

The table is shaped like the seed's ablation (rows eta, columns the arms; mean +- sd over seeds); under
it, per arm and eta, the mechanism: the staleness reached, the mean KL(behaviour || current), the
clipped and the dropped/masked token fractions and the effective batch. Writes
benchmarks/results/NAME.{json,md,png} (``--name``, default staleness_ablation, or
staleness_ablation_quick with ``--quick``; final accuracy and KL
against eta, accuracy against versions at the largest eta) and NAME_selection.png (the DIS and SAO
arms' masked fraction by completion length and token staleness, ``rl.selection``); prints one JSON
object (last line). A rerun with the same ``--workdir`` reuses every finished arm.

The full grid is about 6 hours of both cores, more than one sitting, so each finished arm's record (its
outcome and mechanism, the commit and machine it ran on, and the warm start's accuracy) is also kept
in benchmarks/results/NAME_arms/ARM.json, which is committed: a rerun on any machine reuses those
records and runs only the missing cells, and refuses to mix in records whose configuration or warm
start differs from this run's. A record also names the last commit of the training code
(``asyncrl_jax/``, ``configs/``) it ran; one that names another is run again, and a grid does not run
from uncommitted training code. ``--assemble-only`` writes the table from the records alone, with the
missing cells marked as not run.

``--first-seed S`` runs seeds S..S+N-1 (fresh seeds for a confirmation: a seed replays its run).
``--final-eval 500x16`` evaluates each arm's last version on 500 held-out problems with 16 samples
each (``data.final_eval_problems`` / ``final_eval_samples``; pass@1 SE at most 0.56 points); the
records keep each figure's standard error (``final_se``, ``final_greedy_se``).

``--regime=probe`` is the regime of the decoupled-vs-naive diagnosis: learning rate 3e-4, 2 optimizer
updates per batch, eta 8, 80 versions, evaluated every 20. Its arms are naive PPO, decoupled PPO as
shipped (behaviour weight truncated at 1), decoupled PPO with no guard and DIS, 3 seeds each, with
AReaL's cap-5 guard alone and synchronous PPO (eta 0) as one-seed context; it writes
benchmarks/results/staleness_probe.{json,md,png} with mean +- sd at version 20 and at the end, and each
arm's weight statistics from its metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from asyncrl_jax import cli  # noqa: E402  pylint: disable=wrong-import-position

cli.ensure_cpu_devices(4)

from benchmarks.common import code_commit, machine, percent_cell, read_json, pyplot, run_logged, write_result  # noqa: E402  pylint: disable=wrong-import-position

CONFIG = os.path.join(ROOT, "configs", "default.py")
# The grid's arms: name -> (rl.loss, extra overrides). `sao` is SAO whole: one rollout per prompt,
# value advantages from the learner's critic, DIS.
ARMS = {
    "ppo": ("ppo", []),
    "decoupled_ppo": ("decoupled_ppo", []),
    "dis": ("dis", []),
    "sao": ("dis", ["--config.rl.advantage=value", "--config.rl.group_size=1",
                    "--config.rl.value_pretrain_versions=5"]),
    # the seeds' naive baseline: PPO with the old log-probs recomputed before the update
    "ppo_recompute": ("ppo_recompute", []),
    # AReaL's shipped guard: drop tokens whose behaviour weight exceeds 5, no truncation
    "decoupled_ppo_cap5": ("decoupled_ppo", ["--config.rl.behav_weight_cap=5",
                                             "--config.rl.behav_weight_clip=inf"]),
    # corrections on the naive baseline: truncated IS of pi_prox / pi_behav at 2 (TIS), and
    # IcePop's token mask [0.5, 2] on the same ratio
    "ppo_recompute_tis2": ("ppo_recompute", ["--config.rl.correction.ratio=prox",
                                             "--config.rl.correction.tis_cap=2"]),
    "ppo_recompute_icepop": ("ppo_recompute", ["--config.rl.correction.ratio=prox",
                                               "--config.rl.correction.icepop_low=0.5",
                                               "--config.rl.correction.icepop_high=2"]),
    "dis_sign_aware": ("dis", ["--config.rl.dis_sign_aware=True"]),
}
UNBOUNDED = "unbounded"
ETAS = [0, 2, 4, 8, 16, UNBOUNDED]
# rl.staleness_mode=pinned: eta is the staleness of every token (no "unbounded": pinned to the run's
# length, every batch would be decoded by version 0)
PINNED_ETAS = [0, 4, 8, 16]
PINNED_NOTE = ("Staleness pinned (rl.staleness_mode=pinned): every token trained at version v was sampled "
               "by version max(0, v - eta). Arms: `ppo_recompute` is the seeds' naive baseline (PPO with "
               "the old log-probs recomputed before the update: the behaviour policy is ignored), `ppo` "
               "PPO on the behaviour ratio, `decoupled_ppo` the shipped default (behaviour weight "
               "truncated at 1), `decoupled_ppo_cap5` with AReaL's guard instead (drop w > 5), `dis` "
               "SAO's DIS (0.7, 6), `dis_sign_aware` DIS masking only tokens whose drift agrees with "
               "their advantage.")
BOUNDED_NOTE = ("Arms: `ppo` is PPO on the behaviour ratio (called naive PPO when this grid ran), "
                "`decoupled_ppo` the shipped default, `dis` SAO's masked importance sampling, `sao` SAO "
                "whole: one rollout per prompt, value advantages (the learner's critic) and DIS. eta "
                f"`{UNBOUNDED}` is no bound: admission is limited by the decode slots alone.")
PINNED_ARMS = ["ppo_recompute", "ppo", "decoupled_ppo", "decoupled_ppo_cap5", "dis", "dis_sign_aware"]
# The regime where staleness can hurt (the search is in RESULTS.md): the probe's learning rate and
# optimizer updates per batch, where KL(behaviour || current) at eta 8 is already 0.1-0.3.
GRID = dict(overrides=["--config.learner.learning_rate=3e-4", "--config.learner.ppo_minibatches=2"],
            steps=80)
QUICK = dict(etas=[0, 16], arms=["ppo", "decoupled_ppo", "dis", "sao"], steps=60)
PROBE = dict(overrides=["--config.learner.learning_rate=3e-4", "--config.learner.ppo_minibatches=2"],
             etas=[8], steps=80, eval_every=20, seeds=3)
# The probe's arms: name -> (rl.loss, extra overrides, seeds (None: --seeds), eta (None: the probe's)).
# Single-seed rows are context: AReaL's shipped guard alone, and synchronous PPO in the same regime.
PROBE_ARMS = {
    "ppo": ("ppo", [], None, None),
    "decoupled_ppo": ("decoupled_ppo", [], None, None),
    "decoupled_ppo_uncapped": ("decoupled_ppo", ["--config.rl.behav_weight_cap=inf",
                                                 "--config.rl.behav_weight_clip=inf"], None, None),
    "dis": ("dis", [], None, None),
    "decoupled_ppo_cap5": ("decoupled_ppo", ["--config.rl.behav_weight_cap=5",
                                             "--config.rl.behav_weight_clip=inf"], 1, None),
    "ppo_synchronous": ("ppo", [], 1, 0),
}
# The seed's ablation (AReaL, 1.5B on math, AIME24): eta -> (naive PPO, decoupled PPO).
SEED_TABLE = {0: (42.0, 42.0), 1: (41.8, 42.1), 2: (40.0, 41.8), 4: (23.3, 42.2), 8: (35.7, 41.0),
              16: (35.8, 38.7)}

def _warm_start(work: str, py: str, overrides) -> str:
  """The arms' shared supervised warm start (made once per workdir); returns its export directory."""
  ws_dir = os.path.join(work, "ws")
  ws = os.path.join(ws_dir, "warm_start")
  if not os.path.exists(os.path.join(ws, "model.safetensors")):  # a rerun keeps the arms' warm start
    print(f"[ablation] warm start in {work}", flush=True)
    run_logged([py, "-m", "asyncrl_jax.sft", f"--config={CONFIG}", f"--workdir={ws_dir}",
                f"--config.data.path={os.path.join(work, 'data')}", *overrides], os.path.join(work, "ws.log"))
  return ws


def _run_arm(py: str, work: str, name: str, steps: int, args_list) -> dict:
  """Runs one arm of the main job unless it finished before (a rerun resumes); returns its summary.

  The arms share one compilation cache (``WORKDIR/jax_cache``, unless the environment names one):
  the arms of one objective compile the same programs, which an arm's own cache would compile again
  (about 30 s of an arm's 3-4 minutes here). The cache saves compile time only: a cached program is
  the program the arm would compile."""
  wd = os.path.join(work, name)
  if not os.path.exists(os.path.join(wd, "summary.json")):
    env = dict(os.environ)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(work, "jax_cache"))
    run_logged([py, "-m", "asyncrl_jax.train", f"--config={CONFIG}", f"--workdir={wd}", *args_list],
               os.path.join(work, f"{name}.log"), env=env)
  s = read_json(os.path.join(wd, "summary.json"))
  if s["steps"] != steps:
    raise SystemExit(f"{wd} holds a run of {s['steps']} policy versions, not {steps}: use another --workdir")
  return s


def _eta_flag(eta, steps: int) -> int:
  """``rl.max_staleness`` for an eta of the grid: "unbounded" is the run's length, which no token
  can be older than, so admission is limited by the decode slots alone."""
  return steps if eta == UNBOUNDED else int(eta)


def _parse_final_eval(text: str) -> tuple[int, int]:
  problems, x, samples = text.partition("x")
  if not (x and problems.isdigit() and samples.isdigit() and int(problems) > 0 and int(samples) > 0):
    raise argparse.ArgumentTypeError(f"--final-eval {text!r}: expected PROBLEMSxSAMPLES, e.g. 500x16")
  return int(problems), int(samples)


def _parse_eta(text: str):
  if text == UNBOUNDED:
    return UNBOUNDED
  try:
    eta = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"eta {text!r} is not an integer >= 0 or {UNBOUNDED!r}") from None
  if eta < 0:
    raise argparse.ArgumentTypeError(f"eta {eta} is not an integer >= 0 or {UNBOUNDED!r}")
  return eta


def _arm_record(work: str, name: str, s: dict, **fields) -> dict:
  """One arm's outcome and mechanism from its summary and metrics: accuracy against versions,
  KL(behaviour || current), the clipped and the dropped/masked token fractions, the staleness
  reached, the selection monitor."""
  history = _metrics(os.path.join(work, name, "metrics.jsonl"))
  mean = lambda key: float(np.mean([h[key] for h in history if key in h])) if any(
      key in h for h in history) else None
  return dict(fields, initial=s["initial_eval_accuracy"], initial_greedy=s["initial_eval_greedy_accuracy"],
              # the starting weights on the final evaluation's problems (absent in older records)
              initial_final=s.get("initial_final_eval_accuracy"),
              initial_final_greedy=s.get("initial_final_eval_greedy_accuracy"),
              final=s["final_eval_accuracy"],
              final_greedy=s["final_eval_greedy_accuracy"],
              final_se=s.get("final_eval_accuracy_se"), final_greedy_se=s.get("final_eval_greedy_accuracy_se"),
              final_metric=s.get("final_eval_metric", s.get("eval_metric")),
              final_problems=s.get("final_eval_problems"),
              evals={h["version"]: h["eval_accuracy"] for h in history if "eval_accuracy" in h},
              kl_behav=mean("kl_behav"), kl_behav_prox=mean("kl_behav_prox"), clipped_frac=mean("clipped_frac"),
              dropped_frac=mean("dropped_frac"), mean_staleness=mean("mean_staleness"),
              ratio_p50=mean("ratio_p50"), ratio_p90=mean("ratio_p90"), ratio_p99=mean("ratio_p99"),
              ratio_max=max((h["ratio_max"] for h in history if "ratio_max" in h), default=None),
              sides={k: mean(k) for k in (f"{w}_frac_{side}" for w in ("masked", "clipped")
                                          for side in ("hi_pos", "hi_neg", "lo_pos", "lo_neg"))
                     if mean(k) is not None},
              curves={k: [h.get(k) for h in history] for k in ("reward", "entropy", "ratio_p99",
                                                               "learning_rate", "dropped_frac",
                                                               "kl_behav", "kl_behav_prox")},
              max_staleness_seen=s["max_staleness_seen"], rl_seconds=s["rl_seconds_this_run"],
              value_explained_variance=mean("eval_value_explained_variance"),
              selection=_selection(history))


def paired_differences(runs: list, arm: str, reference: str = "ppo") -> list:
  """``arm``'s final pass@1 minus ``reference``'s, one per (eta > 0, seed) where both ran (the two
  runs share the warm start, the seed and the eta; only the objective differs)."""
  ref = {(r["eta"], r["seed"]): r["final"] for r in runs if r["arm"] == reference and r["final"] is not None}
  return [r["final"] - ref[(r["eta"], r["seed"])] for r in runs
          if r["arm"] == arm and r["eta"] != 0 and r["final"] is not None and (r["eta"], r["seed"]) in ref]


def against_eta0(runs: list, arm: str, eta) -> list:
  """``arm``'s final pass@1 at ``eta`` minus its own at eta 0, one per seed where both ran (paired:
  same warm start, seed and objective; only the staleness differs)."""
  base = {r["seed"]: r["final"] for r in runs if r["arm"] == arm and r["eta"] == 0 and r["final"] is not None}
  return [r["final"] - base[r["seed"]] for r in runs
          if r["arm"] == arm and r["eta"] == eta and r["final"] is not None and r["seed"] in base]


def staleness_fit(runs: list, arm: str):
  """Least-squares line of ``arm``'s final pass@1 on each run's mean staleness reached, or None when
  the runs do not span two staleness values: a comparison of objectives at the staleness their data
  had, which eta only bounds."""
  pts = [(r["mean_staleness"], r["final"]) for r in runs
         if r["arm"] == arm and r["final"] is not None and r.get("mean_staleness") is not None]
  x, y = np.array(pts, float).reshape(-1, 2).T
  if len(pts) < 2 or np.ptp(x) == 0:
    return None
  se = None
  if len(pts) > 2:  # the covariance is scaled by the residuals on n - 2 degrees of freedom
    (slope, intercept), cov = np.polyfit(x, y, 1, cov=True)
    se = float(np.sqrt(cov[0, 0]))
  else:
    slope, intercept = np.polyfit(x, y, 1)
  return dict(intercept=float(intercept), slope=float(slope), slope_se=se, n=len(pts),
              staleness=[float(x.min()), float(x.max())])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--regime", choices=("default", "probe"), default="default",
                 help="probe: the eta-8 regime of the decoupled-vs-naive diagnosis (module docstring)")
  p.add_argument("--quick", action="store_true",
                 help=f"eta {QUICK['etas']}, arms {QUICK['arms']}, one seed, {QUICK['steps']} versions")
  p.add_argument("--staleness-mode", choices=("bounded", "pinned"), default="bounded",
                 help=f"rl.staleness_mode of every arm; pinned: every token trained at version v was "
                 "sampled by version max(0, v - eta), so eta is the staleness itself (result name "
                 "NAME_pinned, etas {PINNED_ETAS}, arms {PINNED_ARMS} by default)")
  p.add_argument("--etas", type=_parse_eta, nargs="*", default=None,
                 help=f"integers >= 0 or {UNBOUNDED!r} (default {' '.join(map(str, ETAS))}; pinned "
                 f"{' '.join(map(str, PINNED_ETAS))})")
  p.add_argument("--arms", nargs="*", default=None, choices=list(ARMS),
                 help=f"default: {list(ARMS)[:4]}; pinned {PINNED_ARMS}")
  p.add_argument("--seeds", type=int, default=None, help="seeds per arm (default 3; quick 1)")
  p.add_argument("--first-seed", type=int, default=0, help="the seeds are FIRST..FIRST+N-1 (default 0)")
  p.add_argument("--final-eval", type=_parse_final_eval, default=None, metavar="PROBLEMSxSAMPLES",
                 help="the last version's evaluation, e.g. 500x16 (default: as every evaluation)")
  p.add_argument("--steps", type=int, default=None, help=f"policy versions per arm (default {GRID['steps']})")
  p.add_argument("--workdir", default="", help="keep the runs here; a rerun reuses finished arms "
                 "(default: a temporary directory)")
  p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
  p.add_argument("--name", default=None, help="result files' name (default staleness_ablation, "
                 "staleness_ablation_quick with --quick)")
  p.add_argument("--override", action="append", default=[], help="extra --config.x=y for every arm "
                 "(after the regime's own, so they win) and for the shared warm start")
  p.add_argument("--arm-override", action="append", default=[], help="extra --config.x=y for the arms "
                 "alone, after --override (the warm start is made without them, so arms of several names "
                 "can start from one warm start, e.g. LoRA adapters added to it)")
  p.add_argument("--assemble-only", action="store_true",
                 help="write the table from the kept arm records (NAME_arms/); run nothing")
  args = p.parse_args(argv)
  if args.regime == "probe":
    return probe(args)
  quick = args.quick
  pinned = args.staleness_mode == "pinned"
  if pinned and UNBOUNDED in (args.etas or []):
    raise SystemExit(f"--staleness-mode=pinned has no eta {UNBOUNDED!r}: every token would be "
                     "decoded by version 0")
  args.name = args.name or ("staleness_ablation_quick" if quick else "staleness_ablation") + (
      "_pinned" if pinned else "")
  if pinned:
    args.override = ["--config.rl.staleness_mode=pinned", *args.override]
  if args.final_eval:
    args.override = [*args.override, f"--config.data.final_eval_problems={args.final_eval[0]}",
                     f"--config.data.final_eval_samples={args.final_eval[1]}"]
  if args.first_seed < 0:
    raise SystemExit(f"--first-seed={args.first_seed}: seeds are integers >= 0")
  etas = args.etas if args.etas is not None else (QUICK["etas"] if quick else PINNED_ETAS if pinned
                                                  else ETAS)
  arms = args.arms or (QUICK["arms"] if quick else PINNED_ARMS if pinned else list(ARMS)[:4])
  seeds = list(range(args.first_seed, args.first_seed + (args.seeds or (1 if quick else 3))))
  steps = args.steps or (QUICK["steps"] if quick else GRID["steps"])
  eval_every = max(1, steps // 4)
  out_dir = args.out or os.path.join(ROOT, "benchmarks", "results")
  grid = dict(steps=steps, overrides=GRID["overrides"] + args.override)
  if args.arm_override:  # (absent otherwise, so that records made before the flag stay valid)
    grid["arm_overrides"] = list(args.arm_override)
  records = ArmRecords(os.path.join(out_dir, f"{args.name}_arms"), grid)
  # the synchronous reference (eta 0) of the quick mode is naive PPO's alone
  plan = [(seed, arm, eta) for seed in seeds for eta in etas for arm in arms
          if not (quick and eta == 0 and arm != "ppo")]
  py, t0 = sys.executable, time.time()
  runs, missing, ws = [], [], None
  code = None if args.assemble_only else code_commit()
  if code is not None and code.endswith("+changes"):
    raise SystemExit("the training code (asyncrl_jax/, configs/) has uncommitted changes: commit them "
                     "first, so that every arm's record names the code it ran")
  for seed, arm, eta in plan:  # seed-major: a partial run holds every cell of seed 0
    loss, extra = ARMS[arm]
    name = f"{arm}_eta{eta}_seed{seed}"
    record = records.get(name)
    if record is not None and code is not None and record.get("code_commit") != code:
      print(f"[ablation] {name} ran training code {record.get('code_commit')}, not {code}: running it "
            "again", flush=True)
      record = None
      if args.workdir:  # (its finished run there is of the other code)
        shutil.rmtree(os.path.join(args.workdir, name), ignore_errors=True)
    if record is None and args.assemble_only:
      missing.append(name)
      continue
    if record is None:
      if ws is None:
        work = args.workdir or tempfile.mkdtemp(prefix="staleness_ablation_")
        os.makedirs(work, exist_ok=True)
        ws = _warm_start(work, py, args.override)
        common = [f"--config.model.hf_path={ws}", f"--config.steps={steps}",
                  f"--config.data.path={os.path.join(work, 'data')}",
                  f"--config.learner.eval_every={eval_every}", f"--config.checkpoint.every_steps={steps}",
                  *GRID["overrides"], *args.override, *args.arm_override]
      print(f"[ablation] {len(runs) + 1}/{len(plan)} {name} ({time.time() - t0:.0f}s so far)", flush=True)
      s = _run_arm(py, work, name, steps, [f"--config.rl.loss={loss}", f"--config.seed={seed}", *common,
                                           f"--config.rl.max_staleness={_eta_flag(eta, steps)}", *extra])
      record = records.put(name, _arm_record(work, name, s, arm=arm, loss=loss, eta=eta, seed=seed,
                                             code_commit=code))
    runs.append(record)
  if not runs:
    raise SystemExit(f"no finished arms in {records.path}: run the grid first")

  def cell(arm, eta, key="final"):
    return [r[key] for r in runs if r["arm"] == arm and r["eta"] == eta and r[key] is not None]

  header = ["eta"] + [f"{arm} (ours)" for arm in arms] + ["seed: naive PPO", "seed: decoupled"]
  rows = [[eta] + [percent_cell(cell(arm, eta)) for arm in arms] +
          list(SEED_TABLE.get(eta, ("-", "-"))) for eta in etas]
  # the warm start's pass@1 as each seed's evaluation samples it (one record per seed: they agree)
  per_seed = [next(r["initial"] for r in runs if r["seed"] == seed) for seed in sorted({r["seed"] for r in runs})]
  initial = float(np.mean(per_seed))
  rows.append(["warm start (before RL)"] + [percent_cell(per_seed)] * len(arms) + ["-", "-"])
  mechanism = ["| arm | eta | seeds | staleness reached (max / mean) | KL(behaviour, current) | clipped "
               "tokens | dropped or masked tokens | effective batch | ratio p50 / p90 / p99 (max) | masked "
               "by side: hi+ / hi- / lo+ / lo- |", "|" + "---|" * 10]
  fmt = lambda xs, f: f.format(np.mean(xs)) if xs else "-"
  for eta in etas:
    for arm in arms:
      if not cell(arm, eta):
        continue
      of = [r for r in runs if r["arm"] == arm and r["eta"] == eta]
      sel = [r["selection"].get("effective_batch") for r in of]
      sel = [x for x in sel if x is not None]
      quant = lambda key: [r[key] for r in of if r.get(key) is not None]
      sides = lambda side: [r["sides"][f"masked_frac_{side}"] for r in of
                            if f"masked_frac_{side}" in r.get("sides", {})]
      ratio = " / ".join(fmt(quant(f"ratio_p{q}"), "{:.2f}") for q in (50, 90, 99))
      ratio += f" ({max(quant('ratio_max')):.3g})" if quant("ratio_max") else ""
      masked = " / ".join(fmt([100 * x for x in sides(side)], "{:.2f}%")
                          for side in ("hi_pos", "hi_neg", "lo_pos", "lo_neg"))
      mechanism.append(
          f"| {arm} | {eta} | {len(cell(arm, eta))} | {max(cell(arm, eta, 'max_staleness_seen'))} / "
          f"{np.mean(cell(arm, eta, 'mean_staleness')):.2f} | {np.mean(cell(arm, eta, 'kl_behav')):.3g} | "
          f"{100 * np.mean(cell(arm, eta, 'clipped_frac') or [0]):.2f}% | "
          f"{100 * np.mean(cell(arm, eta, 'dropped_frac') or [0]):.2f}% | "
          f"{f'{np.mean(sel):.3f}' if sel else '-'} | {ratio} | {masked} |")
  regime = " ".join(GRID["overrides"])
  notes = (f"Held-out pass@1 in % after {steps} policy versions of the main job (configs/default.py, "
           f"{regime}) from one shared supervised warm start; mean +- sd over {len(seeds)} seed(s). "
           + (PINNED_NOTE if pinned else BOUNDED_NOTE) + " Every arm trains the same number of versions on "
           "batches of the same number of trajectories. The seed's columns are AReaL's AIME24 scores "
           "for a 1.5B model on math: a different task and scale, shown for the shape of the curve. "
           f"Each arm's record, with the commit it ran at, is in `{os.path.basename(records.path)}/`; "
           "a rerun reuses them."
           + (f" **Not run yet ({len(missing)} of {len(plan)} cells):** {', '.join(missing)}; the "
              "cells above hold the seeds that finished." if missing else "")
           + "\n\nMechanism, per arm (means over versions and seeds):\n\n" + "\n".join(mechanism))
  result = dict(machine=machine(), config=dict(config=os.path.relpath(CONFIG, ROOT), steps=steps, etas=etas,
                                               arms={a: dict(loss=ARMS[a][0], overrides=ARMS[a][1])
                                                     for a in arms},
                                               seeds=seeds, overrides=GRID["overrides"] + args.override,
                                               arm_overrides=args.arm_override,
                                               quick=quick),
                runs=runs, missing=missing, warm_start_accuracy=initial,
                commits=sorted({r["commit"] for r in runs if "commit" in r}),
                seconds=time.time() - t0)
  summaries, drops = [], []  # paragraphs that go before the mechanism table
  for arm in arms:
    base = np.mean(cell(arm, 0)) if cell(arm, 0) else (np.mean(cell("ppo", 0)) if cell("ppo", 0) else None)
    stale = [e for e in etas if e != 0 and cell(arm, e)]
    result[f"{arm}_max_drop_vs_eta0"] = (None if base is None else
                                         float(max(base - np.mean(cell(arm, e)) for e in etas
                                                   if cell(arm, e))))
    if base is not None and stale:
      worst = max(stale, key=lambda e: base - np.mean(cell(arm, e)))
      drops.append(f"{arm} {100 * (base - np.mean(cell(arm, worst))):.1f} at eta {worst}")
  paired0 = []
  for arm in arms:
    cells = [(eta, against_eta0(runs, arm, eta)) for eta in etas if eta != 0]
    cells = [(eta, d) for eta, d in cells if d]
    for eta, d in cells:
      result.setdefault(f"{arm}_minus_eta0", {})[str(eta)] = [float(x) for x in d]
    if cells:
      paired0.append(f"{arm}: " + ", ".join(f"eta {eta} {percent_cell(d)} (n={len(d)})" for eta, d in cells))
  if paired0:
    summaries.append("Against eta 0, seed by seed (each arm's pass@1 at eta minus its own at eta 0 with the "
                     "same seed), in points, mean +- sd: " + "; ".join(paired0))
  if drops:
    summaries.append("Largest fall from eta 0, in points of mean pass@1 (each arm against its own eta-0 cell; "
                     "where an arm has none, against naive PPO's; negative: no fall): " + "; ".join(drops))
  paired, slopes = [], []
  reference = "ppo_recompute" if pinned else "ppo"
  for arm in arms:
    diffs = paired_differences(runs, arm, reference)
    if arm != reference and diffs:
      paired.append(f"{arm} {percent_cell(diffs)} (n={len(diffs)}, above in {sum(d > 0 for d in diffs)})")
      result[f"{arm}_minus_{reference}_stale"] = [float(d) for d in diffs]
    fit = None if pinned else staleness_fit(runs, arm)  # (pinned: the staleness reached is eta's)
    if fit is not None:
      result[f"{arm}_vs_staleness_reached"] = fit
      se = f" +- {100 * fit['slope_se']:.2f}" if fit["slope_se"] is not None else ""
      slopes.append(f"{arm} {100 * fit['intercept']:.1f} at 0, {100 * fit['slope']:+.2f}{se} per version "
                    f"(n={fit['n']}, mean staleness {fit['staleness'][0]:.1f}-{fit['staleness'][1]:.1f})")
  if paired:
    summaries.append(f"Against {'the naive baseline (ppo_recompute)' if pinned else 'PPO on the behaviour ratio'}"
                     ", run by run: each arm's pass@1 minus its pass@1 at the same eta and seed, over the "
                     "stale cells (eta > 0), in points, mean +- sd: " + "; ".join(paired))
  if slopes:
    summaries.append("Against the staleness each run reached (eta bounds it; the roles' speeds set it): final "
                     "pass@1 on the run's mean staleness, least squares over every run of the arm, in points: "
                     + "; ".join(slopes))
  notes = notes.replace("\n\nMechanism, per arm", "".join(f"\n\n{p}." for p in summaries)
                        + "\n\nMechanism, per arm", 1)
  name = args.name
  md = write_result(name, result, header, rows, notes, out_dir=out_dir)
  _plot(runs, initial, etas, arms, os.path.join(os.path.dirname(md), f"{name}.png"))
  _plot_selection({f"{r['arm']} eta {r['eta']}": r["selection"] for r in runs
                   if r["seed"] == 0 and r["arm"] in ("dis", "sao")},
                  os.path.join(os.path.dirname(md), f"{name}_selection.png"))
  print(f"[ablation] wrote {md}")
  print(json.dumps({"warm_start": initial, **{f"{arm}_eta{eta}": float(np.mean(cell(arm, eta)))
                                               for arm in arms for eta in etas if cell(arm, eta)}}))
  return 0


class ArmRecords:
  """Finished arms' records, one JSON file per arm, kept across machines and sessions.

  A record is reused only if it was made with this run's configuration (``config``: versions and
  overrides) and from a warm start of the same held-out accuracy as the records already kept: the
  warm start is remade on each machine, and a different one would make the cells incomparable. The
  greedy accuracy is compared across all records (it depends on the weights alone); the sampled one
  (pass@1) only within a seed, whose evaluation draws its samples with the run's seed.
  """

  def __init__(self, path: str, config: dict):
    self.path, self.config = path, config

  def get(self, name: str) -> dict | None:
    f = os.path.join(self.path, f"{name}.json")
    if not os.path.exists(f):
      return None
    record = read_json(f)
    record["evals"] = {int(v): acc for v, acc in record["evals"].items()}  # JSON keys are strings
    if record.get("grid") != self.config:
      raise SystemExit(f"{f} was run with {record.get('grid')}, not this run's {self.config}: "
                       "use another --name")
    return record

  def put(self, name: str, record: dict) -> dict:
    kept = [self.get(n[:-5]) for n in sorted(os.listdir(self.path))] if os.path.isdir(self.path) else []
    for key, same in (("initial_greedy", lambda r: True), ("initial", lambda r: r["seed"] == record["seed"])):
      other = next((r for r in kept if same(r) and r.get(key) is not None), None)
      if other is not None and other[key] != record[key]:
        raise SystemExit(f"{name}: the warm start's held-out {key} accuracy is {record[key]}, but "
                         f"{other['arm']} eta {other['eta']} seed {other['seed']} in {self.path} was "
                         f"made from one at {other[key]}: the warm start differs, so these cells "
                         "would not be comparable")
    where = machine()
    record = dict(record, grid=self.config, commit=where["commit"], date=where["date"],
                  processor=where["processor"], cpu_count=where["cpu_count"])
    os.makedirs(self.path, exist_ok=True)
    with open(os.path.join(self.path, f"{name}.json"), "w") as f:
      json.dump(record, f, indent=1, sort_keys=True)
    return record


def _metrics(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def probe(args) -> int:
  """The probe regime: every arm at eta 8 for 80 versions, evaluated every 20 (see module docstring)."""
  seeds = list(range(args.seeds or PROBE["seeds"]))
  steps = args.steps or PROBE["steps"]
  eta = PROBE["etas"][0] if not args.etas else args.etas[0]
  work = args.workdir or tempfile.mkdtemp(prefix="staleness_probe_")
  os.makedirs(work, exist_ok=True)
  py, t0 = sys.executable, time.time()
  ws = _warm_start(work, py, args.override)
  common = [f"--config.model.hf_path={ws}", f"--config.steps={steps}",
            f"--config.data.path={os.path.join(work, 'data')}",
            f"--config.learner.eval_every={PROBE['eval_every']}", f"--config.checkpoint.every_steps={steps}",
            *PROBE["overrides"], *args.override]
  plan = [(seed, arm) for seed in seeds for arm, spec in PROBE_ARMS.items()  # seed-major: a partial
          if spec[2] is None or seed < spec[2]]                                 # run has all of seed 0
  runs = []
  for seed, arm in plan:
    loss, extra, _, arm_eta = PROBE_ARMS[arm]
    arm_eta = eta if arm_eta is None else arm_eta
    name = f"{arm}_eta{arm_eta}_seed{seed}"
    print(f"[probe] {len(runs) + 1}/{len(plan)} {name} ({time.time() - t0:.0f}s so far)", flush=True)
    s = _run_arm(py, work, name, steps, [f"--config.rl.loss={loss}", f"--config.seed={seed}", *common,
                                         f"--config.rl.max_staleness={arm_eta}", *extra])
    history = _metrics(os.path.join(work, name, "metrics.jsonl"))
    evals = {h["version"]: h["eval_accuracy"] for h in history if "eval_accuracy" in h}
    early = [h for h in history if h["version"] <= 20]
    runs.append(dict(arm=arm, loss=loss, seed=seed, eta=arm_eta, initial=s["initial_eval_accuracy"],
                     evals=evals, final=s["final_eval_accuracy"], final_greedy=s["final_eval_greedy_accuracy"],
                     iw_max=max(h.get("iw_max", 0.0) for h in history),
                     kl_behav_first20=float(np.mean([h.get("kl_behav", 0.0) for h in early])),
                     dropped_frac=float(np.mean([h.get("dropped_frac", 0.0) for h in history])),
                     max_staleness_seen=s["max_staleness_seen"], rl_seconds=s["rl_seconds_this_run"],
                     selection=_selection(history)))
  at = lambda arm, key: [r[key] if key != "v20" else r["evals"].get(20) for r in runs if r["arm"] == arm]
  header = ["arm", "eta", "seeds", "pass@1, version 20", f"pass@1, version {steps}", "min over seeds (end)",
            "max weight seen", "KL(behaviour, current), mean v1-20", "dropped tokens"]
  rows = [[arm, at(arm, "eta")[0], len(at(arm, "final")), percent_cell(at(arm, "v20")), percent_cell(at(arm, "final")),
           f"{100 * min(at(arm, 'final')):.1f}",
           f"{max(at(arm, 'iw_max')):.3g}", f"{np.mean(at(arm, 'kl_behav_first20')):.3f}",
           f"{100 * np.mean(at(arm, 'dropped_frac')):.2f}%"] for arm in PROBE_ARMS]
  rows.append(["warm start (before RL)", "-", "-", percent_cell([runs[0]["initial"]]), "-", "-", "-", "-", "-"])
  notes = (f"The probe regime: configs/default.py from one shared warm start, eta {eta}, "
           f"{' '.join(PROBE['overrides'])}, {steps} policy versions; held-out pass@1 in % (4 samples "
           f"at T=1 on 256 test problems), mean +- sd over the seeds. `decoupled_ppo` is the shipped "
           "default (behaviour weight truncated at 1, no cap); `decoupled_ppo_uncapped` has no guard "
           "(cap and truncation inf); `decoupled_ppo_cap5` is AReaL's shipped guard alone (drop tokens "
           "with w > 5); `ppo_synchronous` is naive PPO at eta 0, the oracle. 'max weight seen' is the "
           "largest importance weight the loss applied (w for decoupled PPO, the ratio to the behaviour "
           "policy for PPO and DIS). A rerun resumes finished arms, so arms may come from earlier "
           "commits with the same losses.\n\nThe cause (benchmarks/objective_diagnosis.py on a recorded run "
           "without a guard; docs/decisions/0004): no bug (behaviour log-probs match recomputation to 2e-5, also "
           "across interrupted generations; the gradient matches a numpy reference). Under eta 8 the "
           "weight w = pi_prox / pi_behav is heavy-tailed (maximum 100-350) and the ~1% of tokens with "
           "w > 5 carry 50-100% of the gradient norm. Unbounded, they include good tokens already "
           "reinforced since sampling, a feedback loop naive PPO's clip excludes; dropped above a cap "
           "(AReaL's 5), they take with them the stale mistakes the policy has come to prefer, whose "
           "push-down is most of the corrective signal (naive PPO keeps it). Truncating w at 1 keeps "
           "every token at no more than a fresh token's weight, and is the shipped default.")
  result = dict(machine=machine(), config=dict(config=os.path.relpath(CONFIG, ROOT), steps=steps, eta=eta,
                                               overrides=PROBE["overrides"] + args.override, seeds=seeds,
                                               arms={k: dict(loss=v[0], overrides=v[1], seeds=v[2] or len(seeds),
                                                             eta=eta if v[3] is None else v[3])
                                                     for k, v in PROBE_ARMS.items()}),
                runs=runs, seconds=time.time() - t0)
  md = write_result("staleness_probe", result, header, rows, notes,
                    **({"out_dir": args.out} if args.out else {}))
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6.5, 4))
  for arm in PROBE_ARMS:
    rs = [r for r in runs if r["arm"] == arm]
    xs = [0] + sorted(rs[0]["evals"])
    ys = np.array([[r["initial"]] + [r["evals"][x] for x in xs[1:]] for r in rs])
    ax.errorbar(xs, ys.mean(0), yerr=ys.std(0, ddof=1) if len(rs) > 1 else None, marker="o", capsize=3,
                label=arm)
  ax.set_xlabel("policy version")
  ax.set_ylabel("held-out pass@1")
  ax.set_title(f"probe regime, eta {eta} (ppo_synchronous: eta 0)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(os.path.dirname(md), "staleness_probe.png"), dpi=120)
  plt.close(fig)
  _plot_selection({r["arm"]: r["selection"] for r in runs if r["seed"] == 0},
                  os.path.join(os.path.dirname(md), "staleness_probe_selection.png"))
  print(f"[probe] wrote {md}")
  print(json.dumps({arm: dict(v20=float(np.mean(at(arm, "v20"))), final=float(np.mean(at(arm, "final"))))
                    for arm in PROBE_ARMS}))
  return 0


def _selection(history: list) -> dict:
  """An arm's selection-bias monitor (``rl.selection``) from its metrics records: each
  ``masked_frac_*`` averaged over the versions that report it, and ``effective_batch`` likewise ({}
  before it existed)."""
  sums, counts = {}, {}
  for h in history:
    for k, v in h.items():
      if k.startswith("masked_frac_") or k == "effective_batch":
        sums[k], counts[k] = sums.get(k, 0.0) + v, counts.get(k, 0) + 1
  return {k: sums[k] / counts[k] for k in sums}


def _plot_selection(selection: dict, path: str) -> None:
  """Masked fraction by completion-length bucket and by token staleness, one line per arm."""
  arms = {name: sel for name, sel in selection.items() if sel}
  if not arms:
    return
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for ax, prefix, label in ((axes[0], "masked_frac_len_", "completion length (tokens)"),
                            (axes[1], "masked_frac_stale_", "token staleness (versions)")):
    for name, sel in arms.items():
      keys = [k for k in sel if k.startswith(prefix)]
      order = sorted(keys, key=lambda k: [int(x) for x in k[len(prefix):].replace("over_", "").split("_")])
      ax.plot([k[len(prefix):] for k in order], [sel[k] for k in order], marker="o",
              label=f"{name} (effective batch {sel.get('effective_batch', 1.0):.2f})")
    ax.set_xlabel(label)
    ax.set_ylabel("policy tokens given weight 0")
    ax.tick_params(axis="x", labelsize=7, rotation=30)
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _plot(runs, initial, etas, arms, path) -> None:
  """Left: final accuracy against eta per arm; middle: accuracy against versions at the largest eta;
  right: KL(behaviour || current) against eta per arm (the mechanism)."""
  plt = pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  of = lambda arm, eta: [r for r in runs if r["arm"] == arm and r["eta"] == eta]
  for arm in arms:
    shown = [e for e in etas if of(arm, e)]
    finals = [[r["final"] for r in of(arm, e)] for e in shown]
    axes[0].errorbar([str(e) for e in shown], [np.mean(v) for v in finals],
                     yerr=[np.std(v, ddof=1) if len(v) > 1 else 0 for v in finals], marker="o", capsize=3,
                     label=arm)
    axes[2].plot([str(e) for e in shown], [np.mean([r["kl_behav"] for r in of(arm, e)]) for e in shown],
                 marker="o", label=arm)
    last = of(arm, etas[-1])
    if last:
      xs = [0] + sorted(last[0]["evals"])
      ys = np.array([[r["initial"]] + [r["evals"][x] for x in xs[1:]] for r in last])
      axes[1].errorbar(xs, ys.mean(0), yerr=ys.std(0, ddof=1) if len(last) > 1 else None, marker="o",
                       capsize=3, label=arm)
  axes[0].axhline(initial, color="gray", ls=":", label="warm start")
  axes[0].set(xlabel="max staleness eta", ylabel="held-out pass@1 (end)")
  axes[1].set(xlabel="policy version", ylabel="held-out pass@1", title=f"eta {etas[-1]}")
  axes[2].set(xlabel="max staleness eta", ylabel="KL(behaviour || current), mean", yscale="log")
  for ax in axes:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())

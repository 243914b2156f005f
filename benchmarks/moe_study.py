"""Routing replay on a mixture-of-experts policy (issue 57): decoupled PPO without and with it, GSPO with it.

Does replaying the decode servers' experts in the learner narrow the behaviour-proximal mismatch, and
does it change what RL learns? And how does GSPO compare with decoupled PPO, both with replay?

  nice -n 19 .venv/bin/python benchmarks/moe_study.py --workdir DIR    # runs the missing arms, resumes
                            # (9 runs, estimated 25-30 minutes each on 2 cores from a 20-version run)
  .venv/bin/python benchmarks/moe_study.py --assemble-only             # tabulates the records
  .venv/bin/python benchmarks/moe_study.py --quick                     # the smoke run (structure only)

The task is configs/moe.py (the built-in arithmetic task on a tiny Qwen3-MoE-shaped decoder: 8
experts, top 2, each token's experts recorded by the decode servers) on exact staleness 4
(``STALENESS``: ``rl.staleness_mode=pinned``, ``rl.max_staleness=4``: every batch trained at version
v was decoded by version max(0, v - 4)), for the config's 200 versions (``--steps``). Per seed
(``--seeds``, default 3, from ``--first-seed``), one supervised warm start (``python -m
asyncrl_jax.sft`` with the config's warm-start settings and ``--config.seed=S``), shared by the
seed's three arms (``ARMS``), each the main job (``python -m asyncrl_jax.train``) from it with the
same seed:

* ``decoupled_ppo``: decoupled PPO without replay (``rl.replay_routes=False``: the routes are still
  recorded, so the learner's mismatch with them is measured);
* ``decoupled_ppo_replay``: decoupled PPO with replay (``rl.replay_routes=True``);
* ``gspo_replay``: GSPO with replay (``rl.loss=gspo``: its own sequence clip, 1 - 3e-4 to 1 + 4e-4).

Every arm is evaluated as the config evaluates a run (every 20 versions on 256 held-out problems; the
warm start and the last version on 500, 4 samples at T=1, and greedy). Checkpoints are written at the
last version only: an arm interrupted before it finishes starts over, so that its wall time is one
whole run's; each run compiles into its own cache (unless ``JAX_COMPILATION_CACHE_DIR`` names a
shared one), so that every arm's wall time includes its compilation.

Each finished arm's record is kept in benchmarks/results/NAME_arms/ARM_seedS.json (decision 0041):
its figures, per-version curves, the last commit of the training code it ran (``asyncrl_jax/``,
``configs/``) and the machine. A rerun, on any machine, runs only the arms without a record; a record
of other training code is run again, the arms do not run from uncommitted training code (except
``--quick``), and a record of another study configuration (steps, overrides) is refused.

Writes benchmarks/results/NAME.{json,md,png} (NAME ``moe_study``, ``moe_study_quick`` with ``--quick``):
per arm, seed by seed and as mean +- SE with a 95% t interval over seeds (``FIGURES``): held-out
pass@1 before RL (the warm start, as each arm evaluated it) and after, its gain, greedy accuracy
before and after, KL(behaviour || proximal) (``kl_behav_prox``: the k3 estimate over policy tokens
that decoupled PPO and GSPO log, mean over versions), the routing mismatch (``moe_route_mismatch``:
the share of token-layer pairs whose learner top 2 differ from the decode server's, mean over
versions), the router's load-balancing loss (``moe_aux_loss``) and the busiest expert's load times E
(``moe_load_max``), and the run's wall time; then paired differences seed by seed (``PAIRS``: replay
minus no replay; GSPO minus decoupled PPO, both with replay) with 95% t intervals. The summary refuses
records of different training-code commits, of different evaluations, and of different warm starts
within a seed (the warm start is remade on each machine). The plot: the routing mismatch and the KL
per version, mean over seeds.

``--quick``: one seed, 3 versions from a 5-step warm start on small batches and evaluations
(``QUICK``), the runs sharing one compilation cache; its figures mean nothing (the warm start solves
no problem, so every reward is 0 and the objectives' updates are the load-balancing term's alone),
it checks that the study runs end to end (about 4 minutes on 2 cores, most of it compiling).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from asyncrl_jax import cli  # noqa: E402  pylint: disable=wrong-import-position

cli.ensure_cpu_devices(4)

from benchmarks.common import code_commit, machine, pyplot, read_json, run_logged, write_result  # noqa: E402  pylint: disable=wrong-import-position

CONFIG = os.path.join(ROOT, "configs", "moe.py")
NAME = "moe_study"
ETA = 4
STALENESS = ["--config.rl.staleness_mode=pinned", f"--config.rl.max_staleness={ETA}"]
# arm -> (rl.loss, rl.replay_routes)
ARMS = {"decoupled_ppo": ("decoupled_ppo", False),
        "decoupled_ppo_replay": ("decoupled_ppo", True),
        "gspo_replay": ("gspo", True)}
# paired differences, seed by seed: label -> (arm, minus arm)
PAIRS = {"replay_minus_no_replay": ("decoupled_ppo_replay", "decoupled_ppo"),
         "gspo_minus_decoupled_ppo": ("gspo_replay", "decoupled_ppo_replay")}
# metrics.jsonl keys kept per version and averaged over versions in a record
PER_VERSION = ("kl_behav_prox", "kl_behav", "moe_route_mismatch", "moe_aux_loss", "moe_load_max",
               "reward", "clipped_frac", "dropped_frac")
# the summarised figures: key -> (column, scale from the record's units, format)
FIGURES = {
    "initial_final": ("pass@1 before", 100, ".1f"),
    "final": ("pass@1 after", 100, ".1f"),
    "gain": ("pass@1 gain", 100, "+.1f"),
    "initial_final_greedy": ("greedy before", 100, ".1f"),
    "final_greedy": ("greedy after", 100, ".1f"),
    "kl_behav_prox": ("KL(behav || prox)", 1, ".2e"),
    "moe_route_mismatch": ("route mismatch (%)", 100, ".2f"),
    "moe_aux_loss": ("aux loss", 1, ".4f"),
    "moe_load_max": ("load max", 1, ".3f"),
    "wall_seconds": ("wall (s)", 1, ".0f"),
}
PAIRED = ("final", "gain", "final_greedy", "kl_behav_prox", "moe_route_mismatch", "moe_aux_loss",
          "moe_load_max", "wall_seconds")
SEEDS, FIRST_SEED, LEVEL = 3, 0, 0.95
QUICK = dict(steps=3, seeds=1, overrides=[
    "--config.learner.warm_start_steps=5", "--config.learner.warm_start_batch=16",
    "--config.learner.batch_size=32", "--config.learner.warmup_steps=1", "--config.rollout.num_slots=24",
    "--config.data.eval_problems=16", "--config.data.final_eval_problems=32",
    # (compile the shapes used, not every one ahead: most of a 3-version arm is compilation)
    "--config.learner.warm_up=False", "--config.rollout.warm_up=False"])


def config_steps() -> int:
  """configs/moe.py's policy versions (the study's default)."""
  spec = importlib.util.spec_from_file_location("moe_config", CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return int(module.get_config().steps)


def _warm_start(work: str, seed: int, overrides, env=None) -> tuple[str, dict]:
  """The seed's supervised warm start, made once in WORK/ws_seedS; returns (its export, its summary)."""
  ws_dir = os.path.join(work, f"ws_seed{seed}")
  if not os.path.exists(os.path.join(ws_dir, "sft_summary.json")):
    print(f"[moe_study] seed {seed}: warm start in {ws_dir}", flush=True)
    run_logged([sys.executable, "-m", "asyncrl_jax.sft", f"--config={CONFIG}", f"--workdir={ws_dir}",
                f"--config.data.path={os.path.join(work, 'data')}", f"--config.seed={seed}", *overrides],
               os.path.join(work, f"ws_seed{seed}.log"), env=env)
  return os.path.join(ws_dir, "warm_start"), read_json(os.path.join(ws_dir, "sft_summary.json"))


def _arm_argv(arm: str, seed: int, ws: str, work: str, steps: int, overrides) -> list[str]:
  loss, replay = ARMS[arm]
  return [f"--config={CONFIG}", f"--config.model.hf_path={ws}", f"--config.data.path={os.path.join(work, 'data')}",
          f"--config.seed={seed}", f"--config.steps={steps}", f"--config.checkpoint.every_steps={steps}",
          *STALENESS, *overrides, f"--config.rl.loss={loss}", f"--config.rl.replay_routes={replay}"]


def _run_arm(work: str, arm: str, seed: int, argv: list[str], steps: int, code: str,
             env=None) -> tuple[str, dict]:
  """Runs one arm unless its run in WORK finished with training code ``code``; returns (its run
  directory, its summary). A run without a summary (interrupted) starts over, so that its wall time is
  one whole run's. The run's own config.json must name the arm's objective, replay, staleness and
  seed."""
  wd = os.path.join(work, f"{arm}_seed{seed}")
  stamp = f"{wd}.code"  # (the training code the run in wd ran)
  ran_code = None
  if os.path.exists(stamp):
    with open(stamp) as f:
      ran_code = f.read().strip()
  if ran_code != code or not os.path.exists(os.path.join(wd, "summary.json")):
    shutil.rmtree(wd, ignore_errors=True)
    with open(stamp, "w") as f:
      f.write(code)
    run_logged([sys.executable, "-m", "asyncrl_jax.train", f"--workdir={wd}", *argv],
               os.path.join(work, f"{arm}_seed{seed}.log"), env=env)
  s = read_json(os.path.join(wd, "summary.json"))
  if s["steps"] != steps:
    raise SystemExit(f"{wd} holds a run of {s['steps']} versions, not {steps}: use another --workdir")
  c = read_json(os.path.join(wd, "config.json"))
  ran = (c["rl"]["loss"], c["rl"]["replay_routes"], c["rl"]["staleness_mode"], c["rl"]["max_staleness"], c["seed"])
  if ran != (*ARMS[arm], "pinned", ETA, seed):
    raise SystemExit(f"{wd} ran (loss, replay_routes, staleness_mode, max_staleness, seed) = {ran}, not "
                     f"{arm} seed {seed}'s: use another --workdir")
  return wd, s


def _metrics(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def arm_record(run_dir: str, s: dict, **fields) -> dict:
  """One arm's figures from its ``summary.json`` (``s``) and ``metrics.jsonl``: the held-out
  accuracies before and after with their standard errors, each ``PER_VERSION`` key's mean over the
  versions that log it and its curve, each expert's mean load, the held-out evaluations by version,
  the wall time."""
  history = [h for h in _metrics(os.path.join(run_dir, "metrics.jsonl")) if "version" in h]
  curves = {k: [h.get(k) for h in history] for k in PER_VERSION}
  mean = lambda values: float(np.mean(values)) if values else None
  experts = sorted({k for h in history for k in h if k.startswith("moe_load/")}, key=lambda k: int(k[9:]))
  return dict(
      fields, versions=len(history),
      initial_final=s["initial_final_eval_accuracy"], initial_final_greedy=s["initial_final_eval_greedy_accuracy"],
      initial_final_se=s.get("initial_final_eval_accuracy_se"), final=s["final_eval_accuracy"],
      final_greedy=s["final_eval_greedy_accuracy"], final_se=s.get("final_eval_accuracy_se"),
      final_greedy_se=s.get("final_eval_greedy_accuracy_se"), final_metric=s["final_eval_metric"],
      final_problems=s["final_eval_problems"], wall_seconds=s["wall_seconds"],
      rl_seconds=s["rl_seconds_this_run"], max_staleness_seen=s["max_staleness_seen"],
      **{k: mean([v for v in curves[k] if v is not None]) for k in PER_VERSION},
      moe_load=[mean([h[k] for h in history if k in h]) for k in experts],
      evals={str(h["version"]): h["eval_accuracy"] for h in history if "eval_accuracy" in h},
      curves=curves)


class Records:
  """The finished arms' records, one JSON file per arm and seed in ``path``, each made with the study
  configuration ``study`` (its steps and overrides); a record of another is refused."""

  def __init__(self, path: str, study: dict):
    self.path, self.study = path, study

  def _file(self, arm: str, seed: int) -> str:
    return os.path.join(self.path, f"{arm}_seed{seed}.json")

  def _checked(self, f: str) -> dict:
    record = read_json(f)
    if record.get("study") != self.study:
      raise SystemExit(f"{f} was run with {record.get('study')}, not this study's {self.study}: use "
                       "another --name or --out")
    return record

  def get(self, arm: str, seed: int) -> dict | None:
    f = self._file(arm, seed)
    return self._checked(f) if os.path.exists(f) else None

  def all(self) -> list[dict]:
    if not os.path.isdir(self.path):
      return []
    return [self._checked(os.path.join(self.path, f)) for f in sorted(os.listdir(self.path)) if f.endswith(".json")]

  def put(self, record: dict) -> dict:
    where = machine()
    record = dict(record, study=self.study, commit=where["commit"], date=where["date"],
                  processor=where["processor"], cpu=where["cpu"], cpu_count=where["cpu_count"])
    os.makedirs(self.path, exist_ok=True)
    with open(self._file(record["arm"], record["seed"]), "w") as f:
      json.dump(record, f, indent=1, sort_keys=True)
    return record


def interval(values, level: float = LEVEL) -> dict:
  """Mean, standard error (sd / sqrt(n), ddof 1) and one-sample t interval at ``level`` of
  ``values`` (None where fewer than 2)."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  x = np.asarray([v for v in values if v is not None], np.float64)
  out = dict(mean=float(x.mean()) if x.size else None, se=None, low=None, high=None, n=int(x.size))
  if x.size < 2:
    return out
  se = float(x.std(ddof=1) / np.sqrt(x.size))
  half = float(stats.t.ppf(0.5 + level / 2, x.size - 1)) * se
  return dict(out, se=se, low=out["mean"] - half, high=out["mean"] + half)


def _value(record: dict, key: str):
  """A figure of one record in the table's units (``FIGURES``' scale)."""
  v = record["final"] - record["initial_final"] if key == "gain" else record.get(key)
  return None if v is None else FIGURES[key][1] * v


def summarize(records: list[dict], level: float = LEVEL) -> dict:
  """Per arm each figure seed by seed with its mean, SE and interval; per pair (``PAIRS``) the
  seed-by-seed differences likewise. Refuses records of several training-code commits, of several
  evaluations, or of different warm starts within a seed."""
  commits = sorted({str(r.get("code_commit")) for r in records})
  if len(commits) > 1:
    where = {c: sorted(f"{r['arm']} seed {r['seed']}" for r in records if str(r.get("code_commit")) == c)
             for c in commits}
    raise SystemExit("the records ran different training code (decision 0041): "
                     + "; ".join(f"{c}: {', '.join(w)}" for c, w in where.items())
                     + ". Rerun the study (a run reruns the records of other training code)")
  evaluations = sorted({f"{r['final_metric']}, {r['final_problems']} problems" for r in records})
  if len(evaluations) > 1:
    raise SystemExit(f"the arms were evaluated differently ({'; '.join(evaluations)})")
  for seed in sorted({r["seed"] for r in records}):
    starts = {(r["initial_final"], r["initial_final_greedy"]) for r in records if r["seed"] == seed}
    if len(starts) > 1:
      raise SystemExit(f"seed {seed}'s arms started from different warm starts (held-out pass@1, greedy: "
                       f"{sorted(starts)}): the warm start was remade differently; rerun the seed's arms "
                       "from one")
  by_arm = {arm: sorted((r for r in records if r["arm"] == arm), key=lambda r: r["seed"]) for arm in ARMS}
  arms = {}
  for arm, runs in by_arm.items():
    arms[arm] = dict(seeds=[r["seed"] for r in runs])
    for key in FIGURES:
      values = [_value(r, key) for r in runs]
      arms[arm][key] = dict(per_seed=values, **interval(values, level))
  pairs = {}
  for label, (a, b) in PAIRS.items():
    other = {r["seed"]: r for r in by_arm[b]}
    both = [(r, other[r["seed"]]) for r in by_arm[a] if r["seed"] in other]
    pairs[label] = dict(arms=[a, b], seeds=[r["seed"] for r, _ in both])
    for key in PAIRED:
      diffs = [None if _value(x, key) is None or _value(y, key) is None else _value(x, key) - _value(y, key)
               for x, y in both]
      pairs[label][key] = dict(per_seed=diffs, **interval(diffs, level))
  return dict(code_commit=commits[0] if commits else None, evaluation=evaluations[0] if evaluations else None,
              arms=arms, pairs=pairs)


def _cell(d: dict, fmt: str) -> str:
  """mean +- SE [low, high], or the mean alone (one seed), or "-"."""
  if d["mean"] is None:
    return "-"
  if d["se"] is None:
    return f"{d['mean']:{fmt}}"
  return f"{d['mean']:{fmt}} +- {d['se']:{fmt.lstrip('+')}} [{d['low']:{fmt}}, {d['high']:{fmt}}]"


def _table(header: list, rows: list) -> str:
  return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                   + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def assemble(out_dir: str, name: str, study: dict, seeds) -> dict | None:
  """Writes OUT_DIR/NAME.{json,md,png} from the kept records of ``study`` (None, and nothing
  written, without any); ``seeds``: the seeds planned, whose arms without a record are named."""
  records = Records(os.path.join(out_dir, f"{name}_arms"), study).all()
  if not records:
    print(f"[moe_study] no records in {os.path.join(out_dir, name + '_arms')}: run the study first")
    return None
  summary = summarize(records)
  arms_rows = [[arm, len(s["seeds"]), *(_cell(s[k], FIGURES[k][2]) for k in FIGURES)]
               for arm, s in summary["arms"].items()]
  pair_rows = [[label, f"{a} - {b}", len(p["seeds"]), *(_cell(p[k], FIGURES[k][2]) for k in PAIRED)]
               for label, p in summary["pairs"].items() for a, b in [p["arms"]]]
  missing = [f"{arm} seed {seed}" for seed in seeds for arm in ARMS
             if seed not in summary["arms"][arm]["seeds"]]
  note = (
      f"configs/moe.py (8 experts, top 2, routes recorded), pinned staleness eta {ETA}, {study['steps']} "
      f"versions{', ' + ' '.join(study['overrides']) if study['overrides'] else ''}; per seed one "
      "supervised warm start shared by the seed's three arms (`--config.seed` = the seed). Arms: "
      "`decoupled_ppo` without replay (routes recorded, the mismatch measured), `decoupled_ppo_replay` "
      "with replay, `gspo_replay` GSPO with replay (its own sequence clip). Held-out pass@1 and greedy "
      f"accuracy in points ({summary['evaluation']}; before: the warm start, as each arm evaluated it). "
      "KL(behav || prox): metrics.jsonl's `kl_behav_prox` (k3 estimate of KL(behaviour || proximal) "
      "over policy tokens), mean over versions. Route mismatch: `moe_route_mismatch` (token-layer pairs "
      "whose learner top 2 differ from the decode server's, in %), mean over versions; aux loss "
      "`moe_aux_loss` (1 when balanced) and load max `moe_load_max` (busiest expert's share x E, 1 when "
      "balanced), means over versions. Wall: summary.json's `wall_seconds` (start-up, compilation, "
      "every evaluation, RL). Each figure: mean +- SE [95% t interval] over seeds (the mean alone "
      f"with one seed). Training code: {summary['code_commit']}; each arm's record is in `{name}_arms/`."
      + (f" **Not run yet:** {', '.join(missing)}." if missing else "")
      + "\n\nPer arm:\n\n" + _table(["arm", "seeds", *(FIGURES[k][0] for k in FIGURES)], arms_rows)
      + "\n\nPaired differences, seed by seed (same warm start and seed; mean +- SE [95% t interval]):\n\n"
      + _table(["pair", "difference", "seeds", *(FIGURES[k][0] for k in PAIRED)], pair_rows)
      + "\n\nSeed by seed:")
  header = ["arm", "seed", *(FIGURES[k][0] for k in FIGURES), "RL (s)", "staleness reached", "code"]
  shown = lambda r, k: "-" if _value(r, k) is None else f"{_value(r, k):{FIGURES[k][2]}}"
  rows = [[r["arm"], r["seed"], *(shown(r, k) for k in FIGURES), f"{r['rl_seconds']:.0f}",
           r["max_staleness_seen"], r["code_commit"]]
          for arm in ARMS for r in sorted((r for r in records if r["arm"] == arm), key=lambda r: r["seed"])]
  config = dict(study, seeds=list(seeds), config=os.path.relpath(CONFIG, ROOT), eta=ETA, staleness=STALENESS,
                arms={arm: dict(loss=loss, replay_routes=replay) for arm, (loss, replay) in ARMS.items()},
                units={k: FIGURES[k][0] for k in FIGURES}, level=LEVEL)
  result = dict(machine=machine(), config=config, missing=missing, **summary, records=records)
  md = write_result(name, result, header, rows, notes=note, out_dir=out_dir)
  _plot(records, os.path.join(out_dir, f"{name}.png"))
  print(f"[moe_study] wrote {md}")
  return result


def _plot(records: list[dict], path: str) -> None:
  """The routing mismatch and KL(behaviour || proximal) per version, mean over seeds, one line per arm."""
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for arm in ARMS:
    runs = [r for r in records if r["arm"] == arm]
    for ax, key, scale in ((axes[0], "moe_route_mismatch", 100), (axes[1], "kl_behav_prox", 1)):
      curves = [[np.nan if v is None else scale * v for v in r["curves"][key]] for r in runs]
      if curves and min(map(len, curves)):
        n = min(map(len, curves))
        ax.plot(np.arange(1, n + 1), np.nanmean([c[:n] for c in curves], axis=0), label=arm)
  axes[0].set(xlabel="policy version", ylabel="route mismatch (% of token-layer pairs)")
  axes[1].set(xlabel="policy version", ylabel="KL(behaviour || proximal), k3", yscale="log")
  for ax in axes:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(study: dict, seeds, workdir: str, out_dir: str, name: str, quick: bool = False) -> None:
  """Every arm of every seed without a record (seed by seed, each seed's warm start made when one of
  its arms runs); the table is assembled after each seed. ``quick``: the smoke run (uncommitted
  training code allowed; one compilation cache for every run, WORK/jax_cache, unless the environment
  names one)."""
  code = code_commit()
  if code.endswith("+changes") and not quick:
    raise SystemExit("the training code (asyncrl_jax/, configs/) has uncommitted changes: commit them "
                     "first, so that every arm's record names the code it ran")
  records = Records(os.path.join(out_dir, f"{name}_arms"), study)
  work = workdir or tempfile.mkdtemp(prefix="moe_study_")
  os.makedirs(work, exist_ok=True)
  env = None  # (the full study: each run's own cache, in its workdir: its wall time includes compiling)
  if quick:
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.environ.get("JAX_COMPILATION_CACHE_DIR")
               or os.path.join(work, "jax_cache"))
  for seed in seeds:
    ws = None
    for arm, (loss, replay) in ARMS.items():
      record = records.get(arm, seed)
      if record is not None and record.get("code_commit") != code:
        print(f"[moe_study] {arm} seed {seed} ran training code {record.get('code_commit')}, not {code}: "
              "running it again", flush=True)
        record = None
      if record is not None:
        continue
      if ws is None:
        ws, ws_summary = _warm_start(work, seed, study["overrides"], env)
      print(f"[moe_study] seed {seed}: {arm} ({study['steps']} versions) in {work}", flush=True)
      wd, s = _run_arm(work, arm, seed, _arm_argv(arm, seed, ws, work, study["steps"], study["overrides"]),
                       study["steps"], code, env)
      records.put(arm_record(wd, s, arm=arm, seed=seed, loss=loss, replay_routes=replay, eta=ETA,
                             steps=study["steps"], code_commit=code,
                             warm_start={k: ws_summary.get(k) for k in ("steps", "seconds", "final_loss")}))
    assemble(out_dir, name, study, seeds)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=None, help="policy versions per arm (default: configs/moe.py's)")
  p.add_argument("--seeds", type=int, default=None, help=f"seeds (default {SEEDS}; --quick {QUICK['seeds']})")
  p.add_argument("--first-seed", type=int, default=FIRST_SEED)
  p.add_argument("--workdir", default="", help="the warm starts and runs (default: a temporary directory); "
                 "the records, not the runs, say what is finished")
  p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
  p.add_argument("--name", default=None, help=f"result files' name (default {NAME}, {NAME}_quick with --quick)")
  p.add_argument("--override", action="append", default=[], help="extra --config.x=y for every arm and "
                 "the warm starts (recorded: records of other overrides are refused)")
  p.add_argument("--quick", action="store_true", help=f"{QUICK['seeds']} seed, {QUICK['steps']} versions, "
                 "a tiny warm start and small batches: the smoke run")
  p.add_argument("--assemble-only", action="store_true", help="write the tables from the records; run nothing")
  args = p.parse_args(argv)
  if args.first_seed < 0:
    raise SystemExit(f"--first-seed={args.first_seed}: seeds are integers >= 0")
  steps = args.steps or (QUICK["steps"] if args.quick else config_steps())
  seeds = args.seeds or (QUICK["seeds"] if args.quick else SEEDS)
  seeds = range(args.first_seed, args.first_seed + seeds)
  # (what a record must have been made with; the seeds are not part of it: more can be added)
  study = dict(steps=steps, overrides=[*(QUICK["overrides"] if args.quick else []), *args.override])
  name = args.name or (f"{NAME}_quick" if args.quick else NAME)
  if not args.assemble_only:
    run(study, seeds, args.workdir, args.out, name, quick=args.quick)
  result = assemble(args.out, name, study, seeds)
  if result is not None:
    print(json.dumps({arm: {k: s[k]["mean"] for k in ("final", "kl_behav_prox", "moe_route_mismatch", "wall_seconds")}
                      for arm, s in result["arms"].items()}))
  return 0


if __name__ == "__main__":
  sys.exit(main())

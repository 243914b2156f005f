"""Does RL still learn with LoRA adapters alone, and with int8 decode servers? Side by side against
full-weight RL from one warm start.

  nice -n 19 .venv/bin/python benchmarks/lora_int8_learning.py --seeds 3 --workdir=DIR
  .venv/bin/python benchmarks/lora_int8_learning.py --assemble-only

Every variant (``VARIANTS``) is decoupled PPO at eta 0 on exact staleness (``rl.staleness_mode=pinned``:
every batch is sampled by the version it trains) in the regime of the staleness factors' (a)
(``staleness_factors.py``: learning rate 3e-4, 2 optimizer updates per version, 80 versions, where RL
gains about 10 points of pass@1 over the warm start), run by ``staleness_ablation.py`` with
``--final-eval 500x16``. The variant's change is an ``--arm-override``: the warm start is made once
without it and copied into every variant's work directory, so all variants start from the same
weights (the records check it: same held-out accuracy). A LoRA variant puts fresh adapters (B = 0)
on the warm-start weights, which it then computes exactly; its learner trains the adapters alone.

``--assemble-only`` writes benchmarks/results/lora_int8_learning.{json,md}: per variant the final
pass@1 (500 x 16) and greedy accuracy, the gain over the warm start with its Welch 95% interval, the
gain as a share of full-weight RL's, and two KLs per version: KL(behaviour || proximal)
(``kl_behav_prox``: at eta 0 the mismatch between the decode servers' model and the learner's weights
it was published from, zero up to float rounding in full precision, the quantization's with int8) and
KL(behaviour || learner) (``kl_behav``: that mismatch plus the update's own step within the version,
which at these step sizes is the larger part).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import machine, percent_cell, read_json, write_result  # noqa: E402  pylint: disable=wrong-import-position

STEPS = 80
# name -> (what changes, arm overrides)
VARIANTS = {
    "full": ("full-weight RL, weights served in the model dtype (float32) (reference)", []),
    "lora8": ("LoRA rank 8 on q,k,v,o,gate,up,down (alpha 16), the same learning rate",
              ["--config.model.lora.rank=8"]),
    "lora8_lr10x": ("LoRA rank 8, 10x the learning rate (3e-3)",
                    ["--config.model.lora.rank=8", "--config.learner.learning_rate=3e-3"]),
    "int8": ("full-weight RL, decode servers in int8 (rollout.weight_dtype=int8)",
             ["--config.rollout.weight_dtype=int8"]),
}


def _mean_curve(curves: list) -> list:
  """The per-version mean of the seeds' curves (``None`` entries and missing curves left out)."""
  curves = [c for c in curves if c]
  if not curves:
    return []
  return [float(np.mean(vals)) if (vals := [c[i] for c in curves if i < len(c) and c[i] is not None]) else None
          for i in range(max(map(len, curves)))]


def _name(variant: str) -> str:
  return f"lora_int8_learning_{variant}"


def run(variant: str, seeds: int, workdir: str) -> int:
  """Runs (or completes) one variant's arms through ``staleness_ablation.main``, from the warm start
  already made in another variant's directory when there is one."""
  from benchmarks import staleness_ablation  # pylint: disable=import-outside-toplevel
  work = os.path.join(workdir, variant)
  os.makedirs(work, exist_ok=True)
  for other in VARIANTS:
    src = os.path.join(workdir, other)
    if other != variant and os.path.exists(os.path.join(src, "ws", "warm_start", "model.safetensors")):
      for part in ("ws", "data"):
        if not os.path.exists(os.path.join(work, part)):
          shutil.copytree(os.path.join(src, part), os.path.join(work, part))
      break
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(workdir, "jax_cache"))
  argv = ["--staleness-mode=pinned", "--steps", str(STEPS), "--arms", "decoupled_ppo", "--etas", "0",
          "--seeds", str(seeds), "--final-eval", "500x16", "--name", _name(variant), "--workdir", work,
          *(f"--arm-override={o}" for o in VARIANTS[variant][1])]
  return staleness_ablation.main(argv)


def _records(out_dir: str, variant: str) -> list[dict]:
  path = os.path.join(out_dir, f"{_name(variant)}_arms")
  if not os.path.isdir(path):
    return []
  return [read_json(os.path.join(path, f)) for f in sorted(os.listdir(path)) if f.endswith(".json")]


def welch(a, b, level: float = 0.95) -> dict:
  """mean(a) - mean(b) with its Welch interval (None without 2 values on each side)."""
  from benchmarks.staleness_factors import welch as welch_at  # pylint: disable=import-outside-toplevel
  return welch_at(a, b, level)


def assemble(out_dir: str) -> dict:
  rows, table = {}, []
  initial = None
  for variant, (change, overrides) in VARIANTS.items():
    recs = _records(out_dir, variant)
    if not recs:
      rows[variant] = dict(change=change, overrides=overrides, seeds=[], missing=True)
      table.append([variant, change, "0", "-", "-", "-", "-", "-", "-", "not run yet"])
      continue
    final = [100 * r["final"] for r in recs]
    # the warm start as the final version was evaluated (500 x 16 and greedy on 500) where the
    # records have it (data.initial_eval_final); older records hold only the first evaluation's
    # (the first 256 problems x 4, which are easier: greedy 64.1 there, 61.2 on all 500)
    like = all(r.get("initial_final") is not None for r in recs)
    start = [100 * (r["initial_final_greedy"] if like else r["initial_greedy"]) for r in recs]
    greedy = [100 * r["final_greedy"] for r in recs]
    ws = [100 * (r["initial_final"] if like else r["initial"]) for r in recs]
    initial = initial if initial is not None else float(np.mean(ws))
    gain = welch(final, ws)
    curves = {key: _mean_curve([r.get("curves", {}).get(key) for r in recs])
              for key in ("kl_behav", "kl_behav_prox")}
    mismatch = [r.get("kl_behav_prox") for r in recs]
    rows[variant] = dict(change=change, overrides=overrides, seeds=sorted(r["seed"] for r in recs),
                         commits=sorted({r["commit"] for r in recs}),
                         code_commits=sorted({r.get("code_commit") for r in recs}),
                         final=final, final_se=[100 * r["final_se"] for r in recs], warm_start=ws,
                         greedy=greedy, warm_start_greedy=start, gain=gain,
                         warm_start_measured_on="the final evaluation's problems" if like else
                         "the first evaluation's 256 problems (x 4)",
                         kl_behav_mean=float(np.mean([r["kl_behav"] for r in recs])),
                         kl_behav_per_version=curves["kl_behav"],
                         # (None where the arms ran before the metric existed)
                         kl_behav_prox_mean=(float(np.mean(mismatch)) if None not in mismatch else None),
                         kl_behav_prox_per_version=curves["kl_behav_prox"],
                         rl_seconds=[r["rl_seconds"] for r in recs])
  full = rows.get("full", {})
  for variant, row in rows.items():
    if row.get("missing"):
      continue
    share = None
    if not full.get("missing") and full.get("gain", {}).get("diff"):
      share = row["gain"]["diff"] / full["gain"]["diff"]
    row["share_of_full_gain"] = share
    g = row["gain"]
    table.append([variant, row["change"], str(len(row["seeds"])), percent_cell(np.asarray(row["final"]) / 100),
                  f"{g['diff']:+.1f}" + (f" [{g['low']:+.1f}, {g['high']:+.1f}]" if g.get("low") is not None else ""),
                  "-" if share is None else f"{share:.2f}",
                  f"{np.mean(row['warm_start_greedy']):.1f}{'' if row['warm_start_measured_on'].startswith('the final') else ' (256)'}"
                  f" -> {percent_cell(np.asarray(row['greedy']) / 100)}",
                  "-" if row["kl_behav_prox_mean"] is None else f"{row['kl_behav_prox_mean']:.2e}",
                  f"{row['kl_behav_mean']:.2e}", ", ".join(row["code_commits"])])
  table.sort(key=lambda r: list(VARIANTS).index(r[0]))
  note = ("Decoupled PPO at eta 0, pinned, learning rate 3e-4 (LoRA 10x: 3e-3), 2 updates per version, "
          f"{STEPS} versions, from one supervised warm start (pass@1 {initial if initial is not None else float('nan'):.1f}). Final: pass@1 on 500 held-out problems x 16 samples (T=1), mean +- sd over seeds, "
          "in points. Gain: final minus the warm start's pass@1 (each seed's own draw; as the final "
          "evaluation where the records hold it, else 256 x 4 of the same problems' first 256, the same "
          "for every variant, so the share does not depend on it), Welch 95% interval. Greedy: a "
          "warm start marked (256) was measured on the first 256 problems only, which are easier (64.1 "
          "there, 61.2 on all 500: greedy_diagnosis), so its fall to the final's 500 reads about 3 "
          "points too large. Share: the gain over full-weight RL's (the acceptance asks >= 0.5 of LoRA). Serving "
          "mismatch: KL(behaviour || proximal) per token, mean over versions: at eta 0 the decode "
          "servers' model against the learner weights it was published from (the int8 mismatch). "
          "KL(behav || learner) adds the update's own step within the version. Per-version KLs are "
          "in the JSON.")
  result = dict(machine=machine(), config=dict(steps=STEPS, variants={v: o for v, (_, o) in VARIANTS.items()}),
                variants=rows, note=note)
  write_result("lora_int8_learning", result,
               ["variant", "change", "seeds", "final pass@1", "gain over warm start", "share of full's gain",
                "greedy warm start -> final", "serving mismatch KL(behav || prox)", "KL(behav || learner)",
                "code"],
               table, notes=note, out_dir=out_dir)
  return result


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--workdir", default="", help="the variants' work directories go under it (required "
                 "to run; a rerun resumes)")
  p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
  p.add_argument("--assemble-only", action="store_true")
  args = p.parse_args(argv)
  if not args.assemble_only:
    if not args.workdir:
      raise SystemExit("--workdir is required to run the variants")
    for variant in args.variants:
      print(f"[lora_int8_learning] {variant}: {VARIANTS[variant][0]}", flush=True)
      run(variant, args.seeds, args.workdir)
  assemble(args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())

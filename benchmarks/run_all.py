"""Runs every benchmark and regenerates benchmarks/RESULTS.md from their result files.

  .venv/bin/python benchmarks/run_all.py --quick          # all of them, quick sizes (about 40 min on 2 cores)
  .venv/bin/python benchmarks/run_all.py --only straggler transfer
  .venv/bin/python benchmarks/run_all.py --kind speed --quick   # or --kind study (benchmarks/README.md)
  .venv/bin/python benchmarks/run_all.py --assemble-only  # rebuild RESULTS.md from results/*.md

Each benchmark writes ``results/<name>.{json,md,png}`` with its machine, config and date; RESULTS.md
collects those sections in a fixed order (a benchmark not run yet says so), with the seed's figures beside
ours where the seed has one. GPU runs (``benchmarks/gpu/run.sh``) write ``results/gpu_*.md``, which are
collected too.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

# name -> (script, quick args, full args, what the seed says)
BENCHMARKS = {
    "straggler": ("straggler.py", ["--quick"], [],
                  "Seed: 38.1% slot utilization, 2.62x headroom, median 1638, mean longest 32437, P(cap) 92%."),
    "planner": ("-m asyncrl_jax.sim.planner", ["--devices", "8", "--decode-tok-s", "4000", "--train-tok-s",
                                                "20000", "--slots-per-device", "32", "--batch", "512",
                                                "--epochs", "50"],
                ["--devices", "8", "--decode-tok-s", "4000", "--train-tok-s", "20000", "--slots-per-device",
                 "32", "--batch", "512", "--epochs", "200"],
                "AReaL chose a 3:1 rollout:learner split by hand; the seed reports 2.77x at eta 2 over eta 0."),
    "packing": ("packing.py", ["--quick"], [], "Seed: dynamic micro-batching +33.7% mean (17-43%)."),
    "engine_throughput": ("engine_throughput.py", ["--quick"], [], "Goal: >= 0.9 of a fused decode loop."),
    "learner_throughput": ("learner_throughput.py", ["--quick"], [], "No seed figure."),
    "code_ab": ("code_ab.py", ["--base", "3b19c27", "--rounds", "2"], ["--base", "3b19c27", "--rounds", "4"],
                "No seed figure: CPU speed of this code against 3b19c27 (before the TPU kernels) on the fixed "
                "workloads above. Goal: no slower (ratio >= 1 within the rounds' spread)."),
    "transfer": ("transfer.py", ["--quick"], [], "No seed figure."),
    "twin": ("twin.py", ["--quick"], [], "No seed figure: the pod's twin (P learner processes, K decode "
             "servers) on one machine."),
    "lora_serving": ("lora_serving.py", ["--quick"], [],
                     "No seed figure: LoRA adapters applied unmerged by the decode step against a merged "
                     "serving copy, on CPU and by the TPU compile."),
    "int8_rollout": ("int8_rollout.py", ["--quick"], [],
                     "No seed figure: int8 decode servers against the serving dtype, by the TPU compile "
                     "(bytes, step time, tokens/s per server) and on CPU."),
    "moe_layer": ("moe_layer.py", ["--quick"], [],
                  "No seed figure: the MoE layer's grouped expert path (`ragged_dot`) against the dense "
                  "reference on CPU, same run, values checked against each other. A change to "
                  "`models/moe.py` reruns it: slower per token than here, on the same machine, is a "
                  "regression (about 3 minutes on 2 cores)."),
    "twin_lora": ("twin.py", ["--quick", "--shapes", "1x1", "2x2", "--lora", "8"],
                  ["--shapes", "1x1", "2x2", "--lora", "8"],
                  "No seed figure: full-weight and LoRA RL side by side on the twin; the bytes a decode "
                  "server pulls per version. Goal (issue 47): adapters < 5% of a full publish."),
    "async_vs_sync": ("async_vs_sync.py", ["--quick"], [],
                      "Seed (AReaL, 1.5B): 2.77x effective throughput at eta 2 over eta 0."),
    "async_vs_sync_split": ("async_vs_sync.py", ["--quick", "--split-cores", "--name", "async_vs_sync_split"],
                            ["--split-cores", "--name", "async_vs_sync_split"],
                            "Seed (AReaL, 1.5B, separate rollout and training GPUs): 2.77x effective "
                            "throughput at eta 2 over eta 0."),
    "async_vs_sync_lognormal": (
        "async_vs_sync.py", ["--workload", "lognormal", "--quick"], ["--workload", "lognormal"],
        "The seed's length shape (lognormal, median 32, sigma 1.15, cap 640: the cap 20x the median). "
        "Seed: 2.62x free-training headroom; AReaL: 2.77x at eta 2. Goal: eta 2 / colocated sync >= 0.9 "
        "x the planner's prediction from rates measured alone."),
    "packing_lognormal": ("packing.py", ["--quick", "--median", "32", "--cap", "640", "--name",
                                         "packing_lognormal"],
                          ["--median", "32", "--cap", "640", "--name", "packing_lognormal"],
                          "Seed (AReaL): dynamic micro-batching +33.7% mean (17-43%)."),
    "throughput_summary": ("throughput_summary.py", [], [],
                           "Reads the two runs above; our figure beside the seed's and AReaL's."),
    "tpu_compile": ("tpu_compile.py", ["--assemble-only"], [],
                    "No seed figure: the shipped TPU configs compiled by the TPU compiler (libtpu) on "
                    "this machine; compiler projections, not measurements. `--quick` assembles the "
                    "recorded reports (a full run compiles every config: about an hour on 2 cores)."),
    "decode_bytes": ("decode_bytes.py", [], [],
                     "Goal (issue 44): each shipped config's decode step within 1.3x of the live-cache "
                     "roofline (serving weights + each slot's KV cache up to its position, over HBM "
                     "bandwidth). Compiler figures, not measurements; needs libtpu (about 2 minutes)."),
    "staleness_ablation_pinned": (
        "staleness_ablation.py", ["--staleness-mode=pinned", "--steps", "40", "--assemble-only"],
        ["--staleness-mode=pinned", "--steps", "40"],
        "The staleness grid on exact staleness (rl.staleness_mode=pinned: every token trained at version "
        "v was sampled by version max(0, v - eta)), in the regime staleness_regime_pinned found, with the "
        "seeds' naive baseline (ppo_recompute). Seed (AReaL): naive PPO 42.0 / 23.3 / 35.7 at eta 0 / "
        "4 / 8; decoupled PPO 42.0 / 42.2 / 41.0."),
    "staleness_regime_pinned": (
        "staleness_ablation.py", ["--staleness-mode=pinned", "--arms", "ppo_recompute", "--etas", "0", "8",
                                  "--steps", "40", "--name", "staleness_regime_pinned", "--assemble-only"],
        ["--staleness-mode=pinned", "--arms", "ppo_recompute", "--etas", "0", "8", "--steps", "40",
         "--name", "staleness_regime_pinned"],
        "Finding the regime first: the seeds' naive baseline alone, eta 0 and 8 on exact staleness, 3 "
        "seeds, 40 versions, learning rate 3e-4 and 2 optimizer updates per version. Goal: it loses at "
        "least 5 points (or half of RL's gain) at eta 8."),
    "staleness_corrections_pinned": (
        "staleness_ablation.py", ["--staleness-mode=pinned", "--arms", "ppo_recompute_tis2",
                                  "ppo_recompute_icepop", "dis_sign_aware", "--etas", "8", "--seeds", "1",
                                  "--steps", "40", "--name", "staleness_corrections_pinned",
                                  "--assemble-only"],
        ["--staleness-mode=pinned", "--arms", "ppo_recompute_tis2", "ppo_recompute_icepop",
         "dis_sign_aware", "--etas", "8", "--seeds", "1", "--steps", "40", "--name",
         "staleness_corrections_pinned"],
        "Which of the new corrections goes into the grid: each at eta 8 (pinned), seed 0, against the "
        "naive baseline's cell of staleness_regime_pinned."),
    "staleness_factors": (
        "staleness_factors.py", ["--assemble-only"], ["--assemble-only"],
        "What makes decoupled PPO's eta-8 gap (8.7 +- 1.2 points in staleness_ablation_pinned; AReaL: about "
        "1): one factor at a time, pinned, eta 0 and 8, final evaluation 500 x 16. The runs are long "
        "(docs/staleness.md: plan, power, budget) and go factor by factor "
        "(`staleness_factors.py --factor NAME --seeds N --workdir DIR`); this assembles their records."),
    "greedy_diagnosis": (
        "greedy_diagnosis.py", ["--assemble-only"], ["--assemble-only"],
        "Why greedy accuracy falls under RL while pass@1 rises: the warm start's greedy completions against "
        "trained arms', by first mistake (staleness_factor_lr_half's arms; rerun with `--run WORKDIR` on "
        "kept arm directories)."),
    "staleness_headline": (
        "staleness_headline.py", ["--assemble-only"], ["--assemble-only"],
        "The headline (docs/staleness.md, phase 2): two recipes, decoupled PPO without and with the KL "
        "term towards the starting policy (rl.kl_coef=0.3, the shipped one), and the seeds' baseline "
        "(ppo_recompute) at eta 0 / 4 / 8 / 16, pinned, 160 versions at lr 7.5e-5, seeds 100-107, final "
        "evaluation 500 x 16. Goal: the recipe within 1.5 points of its eta-0 accuracy at eta 8, the "
        "baseline more than 10 below it, greedy accuracy not below the starting weights'. The runs are "
        "long (`staleness_headline.py --workdir DIR`, seed by seed); this assembles their records."),
    "lora_int8_learning": (
        "lora_int8_learning.py", ["--assemble-only"], ["--assemble-only"],
        "Whether RL learns with LoRA adapters alone and with int8 decode servers: decoupled PPO at eta "
        "0, pinned, 80 versions, 3 seeds, from one warm start, against full-weight RL. Goal: LoRA gains "
        "at least half of what full-weight RL gains; int8 keeps learning with KL(behaviour || learner) "
        "reported per version. The runs are long (`lora_int8_learning.py --seeds 3 --workdir DIR`); "
        "this assembles their records."),
    "moe_study": (
        "moe_study.py", ["--assemble-only"], [],
        "No seed figure: routing replay on a mixture-of-experts policy (issue 57; slime, verl, ROLL, SkyRL and "
        "prime-rl replay the rollout's experts): configs/moe.py at pinned eta 4, 200 versions, 3 seeds, "
        "decoupled PPO without and with replay and GSPO with replay; held-out pass@1 before and after, "
        "KL(behaviour || proximal), the routing mismatch, the load-balancing loss, wall time, paired "
        "differences. The runs are long (`moe_study.py --workdir DIR`, hours on 2 cores); this assembles "
        "their records."),
    "staleness_ablation": ("staleness_ablation.py", ["--assemble-only"], [],
                           "**Run before two fixes** (kept as it was measured): the learning-rate schedule counted policy versions, not optimizer updates (with 2 updates per version the cosine reached its floor half way), staleness was bounded, not pinned (eta was a bound; the staleness reached depended on the roles' speeds), and `ppo` is PPO on the behaviour ratio, not the seeds' naive baseline (`ppo_recompute`). Superseded by staleness_ablation_pinned. Seed (AReaL): decoupled PPO within ~1 point of eta 0 up to eta 8; naive PPO "
                           "drops to 23.3 at eta 4. Goal: a regime where staleness hurts the naive "
                           "objective (KL(behaviour, current) >= 1e-2 at eta 16). Met for the KL (0.02-0.63 "
                           "at eta 16 and beyond), **not for the objective**: here naive PPO is the arm "
                           "staleness hurts least (largest fall 2.4 points), decoupled PPO ends 2.4 +- 3.1 "
                           "points below it run by run but level with it at equal staleness reached "
                           "(its data was staler at equal eta), DIS and SAO collapse. Above eta 4 read "
                           "the staleness reached, not eta. The full grid took about 7 hours of both cores "
                           "over several sittings (each arm's record is kept); `--quick` assembles the "
                           "table from the records."),
    "staleness_ablation_quick": ("staleness_ablation.py", ["--quick"], ["--quick", "--seeds", "3"],
                                 "(Run with the learning-rate schedule bug: see staleness_ablation.) The grid's quick mode: eta 0 (naive PPO) and eta 16 (every arm), 60 "
                                 "versions."),
    "staleness_ablation_gentle": (
        "staleness_ablation.py", ["--name", "staleness_ablation_gentle", "--arms", "ppo", "decoupled_ppo",
                                  "dis", "--etas", "0", "2", "8", "--seeds", "1", "--steps", "100",
                                  "--override=--config.learner.learning_rate=1e-4",
                                  "--override=--config.learner.ppo_minibatches=1"],
        ["--name", "staleness_ablation_gentle", "--arms", "ppo", "decoupled_ppo", "dis", "--etas", "0", "1",
         "2", "4", "8", "--seeds", "2", "--steps", "100", "--override=--config.learner.learning_rate=1e-4",
         "--override=--config.learner.ppo_minibatches=1"],
        "The default learning rate (1e-4, one update per batch), where the policy moves little per "
        "version: nothing can fail here. The supervised-control row comes from the run recorded below "
        "(an earlier version of the script); rl_vs_rft holds the controls now."),
    "staleness_ablation_dis_interval": (
        "staleness_ablation.py", ["--name", "staleness_ablation_dis_interval", "--arms", "dis", "--etas",
                                  "0", "4", "--seeds", "1", "--override=--config.rl.eps_high=0.2",
                                  "--override=--config.rl.eps_low=0.2"],
        ["--name", "staleness_ablation_dis_interval", "--arms", "dis", "--etas", "0", "4", "--seeds", "1",
         "--override=--config.rl.eps_high=0.2", "--override=--config.rl.eps_low=0.2"],
        "(Run with the learning-rate schedule bug: see staleness_ablation.) A diagnosis of the grid's DIS arm, not a grid: DIS with PPO's interval (0.8, 1.2) instead of "
        "SAO's (0.7, 6), same regime and warm start. Compare with the grid's dis row at eta 0 and 4 "
        "(seed 0: 36.7 and 24.2)."),
    "staleness_ablation_ppo_noclip": (
        "staleness_ablation.py", ["--name", "staleness_ablation_ppo_noclip", "--arms", "ppo", "--etas", "0",
                                  "--seeds", "1", "--override=--config.rl.eps_clip=0.999"],
        ["--name", "staleness_ablation_ppo_noclip", "--arms", "ppo", "--etas", "0", "--seeds", "1",
         "--override=--config.rl.eps_clip=0.999"],
        "(Run with the learning-rate schedule bug: see staleness_ablation.) A diagnosis of DIS's deficit at eta 0, not a grid: naive PPO with its clip opened to (0.001, 1.999), "
        "so that nearly no token is clipped. Compare with the grid's ppo at eta 0 (seed 0: 43.0; repeated: "
        "44.7) and with staleness_ablation_dis_nomask."),
    "staleness_ablation_dis_nomask": (
        "staleness_ablation.py", ["--name", "staleness_ablation_dis_nomask", "--arms", "dis", "--etas", "0",
                                  "--seeds", "1", "--override=--config.rl.eps_low=0.999",
                                  "--override=--config.rl.eps_high=1e9"],
        ["--name", "staleness_ablation_dis_nomask", "--arms", "dis", "--etas", "0", "--seeds", "1",
         "--override=--config.rl.eps_low=0.999", "--override=--config.rl.eps_high=1e9"],
        "(Run with the learning-rate schedule bug: see staleness_ablation.) A diagnosis, not a grid: DIS with its interval opened to (0.001, 1e9), so that it masks nothing: "
        "the same gradient as unclipped PPO. Compare with the grid's dis at eta 0 (seed 0: 36.7) and "
        "with staleness_ablation_ppo_noclip."),
    "staleness_ablation_repeat": (
        "staleness_ablation.py", ["--name", "staleness_ablation_repeat", "--arms", "ppo", "--etas", "0",
                                  "--seeds", "1"],
        ["--name", "staleness_ablation_repeat", "--arms", "ppo", "--etas", "0", "--seeds", "1"],
        "(Run with the learning-rate schedule bug: see staleness_ablation.) The grid's ppo eta-0 seed-0 arm run again, same config, seed and warm start, to see how far one "
        "run of an arm is from another (the grid's record: 43.0)."),
    "slow_tools": ("slow_tools.py", ["--quick"], [],
                   "Seed: 4 rollouts finishing at 5, 8, 13 and 40 s wait 23.5 s on average for their group; "
                   "asynchrony should hide slow tools where the learner is not the bottleneck."),
    "tool_controls": ("tool_controls.py", ["--steps", "40"], ["--seeds", "3"],
                      "Issue: RL with the calculator beside RL whose calculator answers nothing and more "
                      "supervised training for the same wall time, 3 seeds: what the tool buys."),
    "rl_vs_rft": ("rl_vs_rft.py", ["--steps", "60"], ["--seeds", "3"],
                  "Goal: RL at least matches rejection-sampling fine-tuning on held-out problems longer "
                  "than any demonstration."),
    "main_job": ("main_job.py", ["--assemble-only"], ["--assemble-only"],
                 "The README's main job (configs/default.py, 200 versions, eta 2) at 3 seeds, each with its "
                 "own warm start: the ranges the README's quick start quotes. The runs take an hour or more "
                 "(`main_job.py --workdir DIR`); this assembles their records."),
    "code_reward": ("code_reward.py", ["--quick"], [],
                    "Issue 58: the code reward's throughput (programs per second on 1-8 threads, one version's "
                    "batch of 128 completions); the learner should wait on rewards under 5% of its time at "
                    "the built-in batch."),
    "staleness_probe": ("staleness_ablation.py", ["--regime", "probe", "--seeds", "1"], ["--regime", "probe"],
                        "(Run with the learning-rate schedule bug: see staleness_ablation.) Seed (AReaL): at eta 8 decoupled PPO 41.0 vs naive PPO 35.7; the issue's probe "
                        "had found the opposite order."),
}


def _run(name: str, quick: bool) -> float:
  script, quick_args, full_args, _ = BENCHMARKS[name]
  args = quick_args if quick else full_args
  root = os.path.dirname(HERE)
  if script.startswith("-m "):
    cmd = [sys.executable, "-m", script[3:], *args]
  else:
    cmd = [sys.executable, os.path.join(HERE, script), *args]
  print(f"[run_all] {name}: {' '.join(cmd[1:])}", flush=True)
  t = time.time()
  proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False)
  if name == "planner" and proc.returncode == 0:  # the planner prints a table; keep it as a result
    planner_md(proc.stdout, args, "A prediction, not a measurement: the planner's ranking for an 8-device "
               "budget with illustrative per-device rates (4000 decode tok/s at 32 slots, 20000 trained "
               "tok/s) on the seed's length distribution. async_vs_sync compares its predictions with "
               "measured runs (with rates taken from the eta 0 run, so only the asynchronous arms test "
               "it: see the error column there).")
  if proc.returncode:
    print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n")
    raise SystemExit(f"[run_all] {name} failed with exit code {proc.returncode}")
  return time.time() - t


def planner_md(stdout: str, args: list, preface: str, *, name: str = "planner",
               out_dir: str = RESULTS) -> str:
  """Writes the planner's printed table (``stdout`` of ``python -m asyncrl_jax.sim.planner ARGS``) as
  ``out_dir/<name>.md`` under ``preface``; returns the path."""
  lines = [ln for ln in stdout.splitlines() if ln and not ln.startswith("{")]
  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  text = [f"# {name}", "", preface, "", "```", *lines, "```", "",
          f"Command: `python -m asyncrl_jax.sim.planner {' '.join(args)}` ({date})", ""]
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{name}.md")
  with open(path, "w") as f:
    f.write("\n".join(text))
  return path


# The two kinds (benchmarks/README.md): how fast the system runs, and what RL learns with it. Every
# benchmark is one or the other; ``--kind`` runs one kind.
STUDIES = ("staleness_ablation_pinned", "staleness_regime_pinned", "staleness_corrections_pinned",
           "staleness_factors", "greedy_diagnosis", "staleness_headline", "lora_int8_learning", "moe_study",
           "staleness_ablation", "staleness_ablation_quick", "staleness_ablation_gentle",
           "staleness_ablation_dis_interval", "staleness_ablation_ppo_noclip", "staleness_ablation_dis_nomask",
           "staleness_ablation_repeat", "tool_controls", "rl_vs_rft", "main_job", "staleness_probe")
KINDS = {"speed": tuple(n for n in BENCHMARKS if n not in STUDIES), "study": STUDIES}


# Sections written by hand in RESULTS.md (several runs, or findings rather than one result file): kept
# as they stand, after the benchmark named with each.
HAND_WRITTEN = {"transfer_faults": "transfer", "soak": "transfer_faults"}


def _sections(text: str) -> dict:
  """RESULTS.md's sections by name (the lines after each ``## name`` up to the next)."""
  out, name = {}, None
  for line in text.splitlines():
    if line.startswith("## "):
      name = line[3:].strip()
      out[name] = []
    elif name is not None:
      out[name].append(line)
  return out


def assemble() -> str:
  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  out = ["# Benchmark results", "",
         f"Assembled {date} by `python benchmarks/run_all.py`; each section below was written by its "
         "benchmark and names its own machine, configuration and date. Plots (PNG) sit next to this file "
         "in `results/`.", ""]
  path = os.path.join(HERE, "RESULTS.md")
  kept = {}
  if os.path.exists(path):
    with open(path) as f:
      kept = _sections(f.read())
  names = list(BENCHMARKS)
  for name, after in HAND_WRITTEN.items():
    if name in kept:  # (after the one named, or at the end when that one is not there)
      names.insert(names.index(after) + 1 if after in names else len(names), name)
  names += sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(RESULTS, "gpu_*.md")))
  for name in names:
    out.append(f"## {name}")
    if name in HAND_WRITTEN:
      out += kept[name]
      continue
    out.append("")
    if name in BENCHMARKS:
      out += [f"*{BENCHMARKS[name][3]}*", ""]
    md = os.path.join(RESULTS, f"{name}.md")
    if not os.path.exists(md):
      out += ["Not run yet.", ""]
      continue
    with open(md) as f:
      body = f.read().splitlines()
    out += [ln for ln in body if not ln.startswith("# ")]  # drop the file's own title
    if os.path.exists(os.path.join(RESULTS, f"{name}.png")):
      out += ["", f"![{name}](results/{name}.png)"]
    out.append("")
  if not any(n.startswith("gpu_") for n in names):
    out += ["## gpu", "", "Not run yet: `benchmarks/gpu/run.sh` needs an accelerator (none was available "
            "where these results were made).", ""]
  with open(path, "w") as f:
    f.write("\n".join(out))
  return path


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="quick sizes for every benchmark")
  p.add_argument("--only", nargs="*", default=None, choices=list(BENCHMARKS))
  p.add_argument("--kind", choices=list(KINDS), default=None,
                 help="run one kind: speed benchmarks or learning studies (benchmarks/README.md)")
  p.add_argument("--assemble-only", action="store_true")
  args = p.parse_args(argv)
  if not args.assemble_only:
    chosen = args.only or (KINDS[args.kind] if args.kind else BENCHMARKS)
    for name in chosen:
      seconds = _run(name, args.quick)
      print(f"[run_all] {name}: done in {seconds:.0f}s", flush=True)
  print(f"[run_all] wrote {assemble()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Synchronous (eta 0) versus asynchronous (eta 1, 2, 4, 8) RL: the real system, side by side.

  .venv/bin/python benchmarks/async_vs_sync.py --quick

One supervised warm start is made first (``python -m asyncrl_jax.sft``), so every arm starts from the same
policy and generates the task's heavy-tailed chains of thought. Then each arm is the main job
(``python -m asyncrl_jax.train``, its own process, same config, devices, model and seed) for the same
number of policy versions, differing only in ``rl.max_staleness``. Per arm, over the steps after
``--skip`` (compilation and pipeline fill excluded):

* effective trained tokens/s (policy tokens trained / wall seconds),
* decode-slot utilization (tokens / slot-steps of the decode steps run x share of time the decode
  server was not waiting for work),
* learner idle fraction (1 - learner seconds / wall seconds),
* the largest staleness seen (over every version, the excluded ones too),
* the planner's prediction (``asyncrl_jax.sim``): the completion lengths the sync arm logged,
  resampled, with the decode step time and training rate measured in the sync arm; once for separate
  rollout and learner devices (the planner's model) and once for decode and training sharing one
  machine's cores (the CPU case: seconds per token = step / (slots x utilization) + 1 / train rate),
  and that again with the re-prefill cost of each weight update (as the arm measured it per update).

``--split-cores`` runs every arm as two processes, a decode server pinned to one core and the main job
pinned to another (one CPU device each, gRPC and jax.experimental.transfer on 127.0.0.1): separate
rollout and learner devices, as on accelerator slices, so decoding and training overlap and the
planner's separate-devices prediction is the one to compare with. Without it, both roles share the
machine's cores in one process.

Besides, the full run repeats eta 2 with ``rollout.on_weight_update=keep_cache`` (``--keep-cache-etas``):
no re-prefill on new weights, decoding continues on the older weights' KV cache.

``--workload lognormal [--median 32 --sigma 1.15 --cap 640]`` measures the seed's length shape instead
of the task's own: every request generates exactly a drawn number of tokens (``rollout.length_workload``,
a per-request minimum length that the learner's log-probs apply too; ``model.max_seq_len`` grows to
fit). The arms are then, in one run on the same cores: colocated synchronous (both roles on both
cores in one process, taking turns: ``mesh.colocate``, eta 0), and on split cores eta 0, 1, 2, 4 and
8 (``--quick``: colocated, eta 0 and eta 2). Before any arm, each role's rate is measured alone on one
core (``benchmarks/role_rates.py``: decode step time at the colocated and the split slot counts,
re-prefill cost, learner tokens/s), and the planner predicts every arm from those rates: no
prediction uses its own arm's measurements. Each request's length is drawn from (seed, prompt,
sample), so every arm trains the same tokens. Writes results/async_vs_sync_lognormal.*.

``predicted_headroom`` is the simulator's ``1 / utilization`` of synchronous LPT-packed batches on the
same lengths, slots and batch size (the seed's definition: free training, lengths known in advance).
Prints one JSON object (last line); writes benchmarks/results/async_vs_sync.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from asyncrl_jax import cli  # noqa: E402  pylint: disable=wrong-import-position

cli.ensure_cpu_devices(4)

from asyncrl_jax.data.workloads import LengthWorkload  # noqa: E402
from asyncrl_jax.learner.learner import idle_fraction as learner_idle_fraction  # noqa: E402  pylint: disable=wrong-import-position
from asyncrl_jax.rollout.stats import DecodeStats  # noqa: E402  pylint: disable=wrong-import-position
from asyncrl_jax.sim import planner, straggler  # noqa: E402  pylint: disable=wrong-import-position
from asyncrl_jax.sim.lengths import LengthModel  # noqa: E402
from benchmarks.common import machine, pyplot, run_logged, write_result  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "default.py")


def _records(path: str) -> list:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def window_metrics(records: list, skip: int) -> dict:
  """Throughput, utilization and idle share over the records after the first ``skip``."""
  if len(records) <= skip + 1:
    raise ValueError(f"need more than {skip + 1} policy versions to measure, got {len(records)}")
  a, rest = records[skip], records[skip + 1:]
  b = rest[-1]
  seconds = b["time"] - a["time"]
  tokens = sum(r["trained_tokens"] for r in rest)
  decode = DecodeStats.from_metrics(b).since(DecodeStats.from_metrics(a))
  idle = decode.idle_seconds / max(decode.servers, 1)
  interrupt = decode.interrupt_seconds
  learner_seconds = sum(r["learner_seconds"] for r in rest)
  return dict(
      interrupt_seconds=interrupt, interrupt_seconds_per_version=interrupt / len(rest),
      interrupt_share_of_decode=interrupt / max(seconds - idle, 1e-9),
      tokens_per_s=tokens / seconds, seconds=seconds, trained_tokens=tokens,
      decode_tokens_per_s=decode.tokens / seconds, drain_seconds_per_version=decode.drain_seconds / len(rest),
      slot_utilization=decode.slot_utilization(seconds) or 0.0,
      slot_occupancy=decode.tokens / max(decode.slot_steps, 1),
      decode_busy_seconds=seconds - idle, slot_steps=decode.slot_steps,
      learner_idle_fraction=learner_idle_fraction(learner_seconds, seconds),
      learner_tokens_per_s=tokens / max(learner_seconds, 1e-9),
      max_staleness_seen=max(r["max_staleness_seen"] for r in records),
      mean_staleness=sum(r["mean_staleness"] for r in rest) / len(rest),
      transfer_seconds_per_version=sum(r.get("transfer_seconds", 0.0) for r in rest) / len(rest))


def _lengths(workdir: str) -> list:
  return planner.lengths_from_log(os.path.join(workdir, "trained_prompts.jsonl"))


def _pin(core: int):
  return lambda: os.sched_setaffinity(0, {core})


def run_split_arm(py: str, flags: list, workdir: str, log_prefix: str, cores: tuple) -> None:
  """One arm as two processes on two cores: a decode server (``python -m asyncrl_jax.rollout.main``)
  pinned to ``cores[0]`` and the main job pinned to ``cores[1]``, one CPU device each, talking gRPC
  (requests, trajectories) and ``jax.experimental.transfer`` (weights) on 127.0.0.1. The topology of
  separate rollout and learner slices, on one machine."""
  os.makedirs(workdir, exist_ok=True)
  registry_file = os.path.join(workdir, "registry_address")
  if os.path.exists(registry_file):
    os.remove(registry_file)
  flags_env = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                       if not f.startswith("--xla_force_host_platform_device_count"))
  env = dict(os.environ, XLA_FLAGS=f"{flags_env} --xla_force_host_platform_device_count=1".strip(),
             ASYNCRL_CPU_DEVICES="1")
  # the learner first: the decode server registers with it (as launch/local.sh starts them)
  with open(f"{log_prefix}.log", "w") as log:
    learner = subprocess.Popen([py, "-m", "asyncrl_jax.train", f"--config={CONFIG}", f"--workdir={workdir}",
                                "--config.rollout.servers=1", *flags], cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT, preexec_fn=_pin(cores[1]))
  server = None
  try:
    deadline = time.time() + 900
    while not os.path.exists(registry_file):
      if learner.poll() is not None or time.time() > deadline:
        raise RuntimeError(f"the learner's registry did not come up (exit code {learner.poll()}); log "
                           f"{log_prefix}.log:\n{_tail(f'{log_prefix}.log')}")
      time.sleep(0.2)
    with open(registry_file) as f:
      registry = f.read().strip()
    with open(f"{log_prefix}.decode.log", "w") as log:
      server = subprocess.Popen([py, "-m", "asyncrl_jax.rollout.main", f"--config={CONFIG}",
                                 f"--config.rollout.learner_address={registry}", *flags], cwd=ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_pin(cores[0]))
    while learner.poll() is None:
      if server.poll() not in (None, 0):
        raise RuntimeError(f"the decode server failed (exit code {server.poll()}); log "
                           f"{log_prefix}.decode.log:\n{_tail(f'{log_prefix}.decode.log')}")
      time.sleep(0.5)
    if learner.returncode != 0:
      raise RuntimeError(f"the learner failed (exit code {learner.returncode}); log {log_prefix}.log:\n"
                         f"{_tail(f'{log_prefix}.log')}")
  finally:
    for proc in (server, learner):
      if proc is None or proc.poll() is not None:
        continue
      proc.terminate()
      try:
        proc.wait(30)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(path: str, n: int = 3000) -> str:
  with open(path) as f:
    return f.read()[-n:]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="eta 0 and 2 only, fewer steps (a few minutes)")
  p.add_argument("--etas", type=int, nargs="*", default=None, help="default: 0 1 2 4 8 (quick: 0 2)")
  p.add_argument("--steps", type=int, default=None, help="policy versions per arm (default 40; quick 14)")
  p.add_argument("--skip", type=int, default=None, help="versions excluded from timing (default 4)")
  p.add_argument("--keep-cache-etas", type=int, nargs="*", default=None,
                 help="also run these etas with rollout.on_weight_update=keep_cache (no re-prefill on "
                      "new weights); default: 2 (quick: none)")
  p.add_argument("--warm-start-steps", type=int, default=120)
  p.add_argument("--workdir", default="", help="keep the runs here (default: a temporary directory)")
  p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
  p.add_argument("--name", default="async_vs_sync", help="result file name (results/<name>.{json,md,png})")
  p.add_argument("--override", action="append", default=[],
                 help="extra --config.x=y for every arm (repeatable)")
  p.add_argument("--split-cores", action="store_true",
                 help="run each arm as a decode-server process pinned to one core and the main job "
                      "pinned to another (one CPU device each): separate rollout and learner devices, "
                      "as on accelerator slices (needs 2 cores; default: one process, shared cores)")
  p.add_argument("--workload", choices=("task", "lognormal"), default="task",
                 help="task: the built-in task's own completion lengths; lognormal: each request "
                      "generates exactly a length drawn from lognormal(--median, --sigma) capped at --cap")
  p.add_argument("--median", type=float, default=32.0, help="lognormal workload: median length")
  p.add_argument("--sigma", type=float, default=1.15, help="lognormal workload: sigma of log length")
  p.add_argument("--cap", type=int, default=640, help="lognormal workload: longest completion")
  p.add_argument("--slots", type=int, default=64,
                 help="lognormal workload: decode slots (default 64: batch 256 is then 4 trajectories per "
                      "slot, as the seed's 512 over 128, so the free-training headroom is the seed's shape)")
  p.add_argument("--profile", default=None, metavar="ETA",
                 help="write a jax profiler trace of 3 versions (after the skipped ones) of the arm at "
                      "this eta to WORKDIR/eta<ETA>/profile (docs/operations.md: where the time goes)")
  args = p.parse_args(argv)
  pinning = hasattr(os, "sched_setaffinity")  # Linux
  if args.workload == "lognormal":
    if args.keep_cache_etas is not None:
      p.error("--keep-cache-etas does not apply to --workload lognormal (its full run has eta 2 with "
              "drain and with keep_cache)")
    cores = tuple(sorted(os.sched_getaffinity(0))[:2]) if pinning else ()
    if len(cores) < 2:
      p.error("--workload lognormal runs split-core arms: it needs 2 CPU cores and core pinning")
    return workload_main(args, cores)
  cores = tuple(sorted(os.sched_getaffinity(0))[:2]) if args.split_cores and pinning else ()
  if args.split_cores and len(cores) < 2:
    p.error("--split-cores needs 2 CPU cores and core pinning (os.sched_setaffinity, Linux); "
            f"this process may use {len(cores) if pinning else 'unknown'} cores")
  etas = args.etas if args.etas is not None else ([0, 2] if args.quick else [0, 1, 2, 4, 8])
  if 0 not in etas or (2 not in etas):
    p.error("--etas must include 0 (the synchronous baseline) and 2 (the reported asynchronous arm)")
  keep_cache_etas = args.keep_cache_etas if args.keep_cache_etas is not None else ([] if args.quick else [2])
  if any(e < 1 for e in keep_cache_etas):
    p.error("--keep-cache-etas must be >= 1 (at eta 0 nothing is in flight when weights change)")
  specs = [(str(e), e, []) for e in etas] + [
      (f"{e} keep_cache", e, ["--config.rollout.on_weight_update=keep_cache"]) for e in keep_cache_etas]
  steps = args.steps or (14 if args.quick else 40)
  skip = args.skip if args.skip is not None else 4
  work = args.workdir or tempfile.mkdtemp(prefix="async_vs_sync_")
  os.makedirs(work, exist_ok=True)
  py = sys.executable
  t0 = time.time()
  print(f"[async_vs_sync] warm start ({args.warm_start_steps} steps) in {work}", flush=True)
  run_logged([py, "-m", "asyncrl_jax.sft", f"--config={CONFIG}", f"--workdir={work}",
        f"--config.learner.warm_start_steps={args.warm_start_steps}", *args.override],
             os.path.join(work, "sft.log"))
  common = [f"--config.model.hf_path={os.path.join(work, 'warm_start')}", f"--config.steps={steps}",
            f"--config.learner.eval_every={10 * steps}", f"--config.checkpoint.every_steps={10 * steps}",
            *args.override]
  arms = {}
  for label, eta, extra in specs:
    name = "eta" + label.replace(" ", "_")
    wd = os.path.join(work, name)
    print(f"[async_vs_sync] eta={label}: {steps} policy versions ({time.time() - t0:.0f}s so far)", flush=True)
    flags = [f"--config.rl.max_staleness={eta}", *common, *extra]
    if args.profile is not None and args.profile == label.replace(" ", "_"):
      flags += [f"--config.learner.profile_start={skip}", "--config.learner.profile_versions=3"]
    if args.split_cores:
      run_split_arm(py, flags, wd, os.path.join(work, name), cores)
    else:
      run_logged([py, "-m", "asyncrl_jax.train", f"--config={CONFIG}", f"--workdir={wd}", *flags],
                 os.path.join(work, f"{name}.log"))
    arms[label] = window_metrics(_records(os.path.join(wd, "metrics.jsonl")), skip)
    with open(os.path.join(wd, "summary.json")) as f:
      summary = json.load(f)
    arms[label].update(eta=eta, summary_max_staleness_seen=summary["max_staleness_seen"])

  # --- the simulator and planner on the same lengths, slots and batch, with the sync arm's rates
  with open(os.path.join(work, "eta0", "config.json")) as f:  # the arm's config, overrides included
    config = json.load(f)
  slots, batch = config["rollout"]["num_slots"], config["learner"]["batch_size"]
  lengths = _lengths(os.path.join(work, "eta0"))
  model = LengthModel(samples=tuple(lengths), cap=config["data"]["max_completion_len"])
  sync_lpt = straggler.simulate_sync(model, epochs=200, batch=batch, slots=slots)
  s = arms["0"]
  step_seconds = s["decode_busy_seconds"] / max(s["slot_steps"] / slots, 1)
  rates = planner.Throughputs(decode_tok_s=slots / step_seconds, train_tok_s=s["learner_tokens_per_s"],
                              slots_per_device=slots)
  for arm in arms.values():
    eta = arm["eta"]
    c = planner.predict(model, rates, rollout_devices=1, learner_devices=1, eta=eta, batch=batch,
                        epochs=100)
    # Shared compute (one CPU): decode and training take turns on the same cores, so only the slot
    # utilization gained from decoupling helps: seconds per token = step / (slots * util) + 1 / train.
    u = straggler.simulate_async(model, epochs=100, batch=batch, slots=slots, eta=eta).slot_utilization
    shared = 1.0 / (step_seconds / (slots * u) + 1.0 / rates.train_tok_s)
    # The same with the re-prefill that every weight update costs the in-flight slots, at the cost per
    # update this arm's decode server measured (in sync-arm decode steps): an engine property that the
    # prediction above leaves out; utilization and throughput are still the simulator's.
    cost = arm["interrupt_seconds_per_version"] / step_seconds
    u_i = straggler.simulate_async(model, epochs=100, batch=batch, slots=slots, eta=eta,
                                   interrupt_cost=cost).slot_utilization
    c_i = planner.predict(model, rates, rollout_devices=1, learner_devices=1, eta=eta, batch=batch,
                          epochs=100, interrupt_cost=cost)
    arm.update(predicted_tokens_per_s=c.tokens_per_s, predicted_slot_utilization=c.slot_utilization,
               predicted_shared_tokens_per_s=shared, interrupt_cost_steps=cost,
               predicted_interrupt_tokens_per_s=c_i.tokens_per_s,
               predicted_shared_interrupt_tokens_per_s=1.0 / (step_seconds / (slots * u_i)
                                                              + 1.0 / rates.train_tok_s))
    # the prediction for this topology: separate devices (split cores) or shared cores, with re-prefill
    arm["predicted_topology_tokens_per_s"] = arm["predicted_interrupt_tokens_per_s" if args.split_cores
                                                 else "predicted_shared_interrupt_tokens_per_s"]
    arm["ratio_vs_sync"] = arm["tokens_per_s"] / s["tokens_per_s"]

  result = dict(
      machine=machine(), config=dict(config=os.path.relpath(CONFIG, ROOT), steps=steps, skip=skip,
                                      etas=etas, keep_cache_etas=keep_cache_etas, slots=slots, batch=batch,
                                      warm_start_steps=args.warm_start_steps, overrides=args.override,
                                      topology=("split cores: decode server on core %d, main job on core "
                                                "%d, one CPU device each" % cores if args.split_cores
                                                else "one process, decode and learner share the cores")),
      arms=arms,
      sync_tokens_per_s=s["tokens_per_s"], async_tokens_per_s=arms["2"]["tokens_per_s"],
      ratio=arms["2"]["tokens_per_s"] / s["tokens_per_s"],
      predicted_headroom=sync_lpt.headroom,
      predicted_ratio=arms["2"]["predicted_tokens_per_s"] / s["predicted_tokens_per_s"],
      predicted_shared_ratio=arms["2"]["predicted_shared_tokens_per_s"] / s["predicted_shared_tokens_per_s"],
      predicted_shared_interrupt_ratio=(arms["2"]["predicted_shared_interrupt_tokens_per_s"]
                                        / s["predicted_shared_interrupt_tokens_per_s"]),
      predicted_interrupt_ratio=(arms["2"]["predicted_interrupt_tokens_per_s"]
                                 / s["predicted_interrupt_tokens_per_s"]),
      async_slot_utilization=arms["2"]["slot_utilization"],
      lengths=dict(n=len(lengths), median=sync_lpt.median_len, mean=sync_lpt.mean_len,
                   mean_longest=sync_lpt.mean_longest, p_cap=sync_lpt.p_cap),
      seconds=time.time() - t0)
  if "2 keep_cache" in arms:
    result["async_keep_cache_tokens_per_s"] = arms["2 keep_cache"]["tokens_per_s"]
    result["keep_cache_ratio"] = arms["2 keep_cache"]["tokens_per_s"] / s["tokens_per_s"]
    result["async_keep_cache_slot_utilization"] = arms["2 keep_cache"]["slot_utilization"]
  topology = "separate devices" if args.split_cores else "shared cores"
  header = ["eta", "trained tok/s", "vs sync", "slot util.", "learner idle", "max staleness",
            "weight transfer per version (s)", "re-prefill per update (decode steps)",
            "planner tok/s (separate devices)", "planner util.", "planner tok/s (shared cores)",
            f"{topology} + re-prefill tok/s", "measured / that"]
  rows = [[eta, a["tokens_per_s"], f"{a['ratio_vs_sync']:.2f}x", f"{a['slot_utilization']:.1%}",
           f"{a['learner_idle_fraction']:.1%}", a["max_staleness_seen"],
           f"{a['transfer_seconds_per_version']:.3f}", f"{a['interrupt_cost_steps']:.1f}",
           a["predicted_tokens_per_s"], f"{a['predicted_slot_utilization']:.1%}",
           a["predicted_shared_tokens_per_s"], a["predicted_topology_tokens_per_s"],
           f"{a['tokens_per_s'] / a['predicted_topology_tokens_per_s']:.2f}"]
          for eta, a in arms.items()]  # eta: the arm's label
  if args.split_cores:
    where = (f"Each arm ran as two processes: a decode server pinned to core {cores[0]} and the main job "
             f"pinned to core {cores[1]}, one CPU device each, exchanging requests and trajectories over "
             "gRPC and weights over jax.experimental.transfer on 127.0.0.1: the topology of separate "
             "rollout and learner slices, so decoding and training can overlap and the planner's "
             "separate-devices model applies. ")
  else:
    where = ("On this CPU machine the virtual devices share the same cores, so running decode and "
             "training at the same time does not add compute: only the slot utilization gained from "
             "decoupling can show up, which is what the shared-cores prediction models "
             "(--split-cores gives each role its own core). ")
  notes = (f"The main job (configs/default.py, warm start {args.warm_start_steps} supervised steps, "
           f"{steps} policy versions per arm, the first {skip} excluded from timing). "
           f"Completion lengths: median {sync_lpt.median_len:.0f}, mean {sync_lpt.mean_len:.1f}, cap "
           f"{config['data']['max_completion_len']}; {slots} decode slots, batch {batch}. Simulator on these "
           f"lengths: synchronous LPT slot utilization {sync_lpt.slot_utilization:.1%}, headroom "
           f"{sync_lpt.headroom:.2f}x. Measured eta 2 / eta 0: {result['ratio']:.2f}x "
           f"(planner: {result['predicted_ratio']:.2f}x if rollout and learner devices are "
           f"independent, {result['predicted_shared_ratio']:.2f}x if they share compute). " + where +
           "The planner's rates come from the eta 0 arm, so its eta 0 figure is a consistency check; "
           "the other arms test the prediction. Each weight update re-prefills every in-flight sequence "
           "(interruptible generation; slots grouped by length); on a CPU prefill is not much cheaper "
           "per token than decoding, so an update costs the decode server several decode steps. The "
           f"last columns add that cost, as each arm's decode server measured it per update, to the "
           f"{topology} prediction. Arms marked keep_cache run with "
           "rollout.on_weight_update=keep_cache: decoding continues on the KV cache the older weights "
           "wrote, with no re-prefill.")
  out_dir = args.out
  md = write_result(args.name, result, header, rows, notes, **({"out_dir": out_dir} if out_dir else {}))
  _plot(arms, os.path.join(os.path.dirname(md), f"{args.name}.png"), topology)
  print(f"[async_vs_sync] wrote {md}")
  print(json.dumps(dict(sync_tokens_per_s=result["sync_tokens_per_s"],
                        async_tokens_per_s=result["async_tokens_per_s"], ratio=result["ratio"],
                        predicted_headroom=result["predicted_headroom"],
                        predicted_ratio=result["predicted_ratio"],
                        predicted_shared_ratio=result["predicted_shared_ratio"],
                        predicted_shared_interrupt_ratio=result["predicted_shared_interrupt_ratio"],
                        predicted_interrupt_ratio=result["predicted_interrupt_ratio"],
                        async_slot_utilization=result["async_slot_utilization"],
                        **{k: result[k] for k in ("async_keep_cache_tokens_per_s", "keep_cache_ratio")
                           if k in result})))
  return 0


# ---------------------------------------------------------------------------- the length workload


COLOCATED = "colocated sync"


def workload_flags(workload: LengthWorkload, slots: int) -> list:
  """The config overrides of a length workload: exact drawn lengths, room for the longest."""
  prompt = 48  # configs/default.py's data.max_prompt_len
  return [f"--config.rollout.length_workload={workload.spec}",
          f"--config.data.max_completion_len={workload.cap}",
          f"--config.model.max_seq_len={-(-(prompt + workload.cap) // 64) * 64}",
          f"--config.rollout.num_slots={slots}"]


def run_colocated_arm(py: str, flags: list, workdir: str, log_path: str, cores: tuple) -> None:
  """Both roles in one process on both cores (one CPU device per core), taking turns: what a user
  without separate rollout devices would run."""
  flags_env = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                       if not f.startswith("--xla_force_host_platform_device_count"))
  env = dict(os.environ, XLA_FLAGS=f"{flags_env} --xla_force_host_platform_device_count={len(cores)}".strip(),
             ASYNCRL_CPU_DEVICES=str(len(cores)))
  run_logged([py, "-m", "asyncrl_jax.train", f"--config={CONFIG}", f"--workdir={workdir}",
              "--config.mesh.colocate=True", *flags], log_path, env=env,
             preexec_fn=lambda: os.sched_setaffinity(0, set(cores)))


def measure_rates(py: str, flags: list, slots: int, cores: tuple, log_path: str) -> dict:
  """Each role alone on one core (``role_rates.py``): decode at the split (``slots``) and colocated
  (``slots / cores``) slot counts, and the learner."""
  per_core = max(1, slots // len(cores))
  flags_env = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                       if not f.startswith("--xla_force_host_platform_device_count"))
  env = dict(os.environ, XLA_FLAGS=f"{flags_env} --xla_force_host_platform_device_count=1".strip(),
             ASYNCRL_CPU_DEVICES="1")
  run_logged([py, os.path.join(ROOT, "benchmarks", "role_rates.py"), f"--config={CONFIG}", f"--slots={slots}",
              f"--slots={per_core}", *flags], log_path, env=env, preexec_fn=_pin(cores[1]))
  with open(log_path) as f:
    rates = json.loads([ln for ln in f.read().splitlines() if ln.startswith("{")][-1])
  rates["decode"] = {d["slots"]: d for d in rates["decode"]}
  return rates


def workload_predictions(rates: dict, workload, *, slots: int, batch: int, cores: int, etas) -> dict:
  """The planner's throughput for each arm from the rates measured alone; the simulator's headroom."""
  lengths = LengthModel(samples=tuple(int(n) for n in workload.sample(20000, seed=7)), cap=workload.cap)
  per_core = max(1, slots // cores)
  split = planner.Throughputs(decode_tok_s=rates["decode"][slots]["decode_tok_s"],
                              train_tok_s=rates["learner"]["train_tok_s"], slots_per_device=slots)
  shared = planner.Throughputs(decode_tok_s=rates["decode"][per_core]["decode_tok_s"],
                               train_tok_s=rates["learner"]["train_tok_s"], slots_per_device=per_core)
  colocated = planner.predict_colocated_sync(lengths, shared, devices=cores, batch=batch, epochs=100)
  out = {COLOCATED: dict(tokens_per_s=colocated.tokens_per_s, slot_utilization=colocated.slot_utilization,
                         learner_idle_fraction=colocated.learner_idle_fraction)}
  cost = rates["decode"][slots]["refill_steps"]
  for eta in etas:
    c = planner.predict(lengths, split, rollout_devices=1, learner_devices=1, eta=eta, batch=batch,
                        epochs=100, interrupt_cost=cost)
    free = straggler.simulate_async(lengths, epochs=100, batch=batch, slots=slots, eta=eta)
    out[str(eta)] = dict(tokens_per_s=c.tokens_per_s, slot_utilization=c.slot_utilization,
                         learner_idle_fraction=c.learner_idle_fraction,
                         free_training_slot_utilization=free.slot_utilization)
  sync = straggler.simulate_sync(lengths, epochs=200, batch=batch, slots=slots)
  decode_alone = straggler.simulate_async(lengths, epochs=100, batch=batch, slots=slots, eta=2)
  return dict(arms=out, headroom=sync.headroom, sync_slot_utilization=sync.slot_utilization,
              free_training_eta2_slot_utilization=decode_alone.slot_utilization,
              learner_bound=split.train_tok_s < decode_alone.slot_utilization * split.decode_tok_s,
              lengths=dict(median=sync.median_len, mean=sync.mean_len, mean_longest=sync.mean_longest,
                           p_cap=sync.p_cap))


def workload_main(args, cores: tuple) -> int:
  try:
    workload = LengthWorkload(median=args.median, sigma=args.sigma, cap=args.cap)
  except ValueError as e:
    raise SystemExit(f"--median/--sigma/--cap: {e}") from None
  etas = args.etas if args.etas is not None else ([0, 2] if args.quick else [0, 1, 2, 4, 8])
  if 2 not in etas:
    raise SystemExit("--etas must include 2 (the reported asynchronous arm)")
  steps = args.steps or (10 if args.quick else 16)
  skip = args.skip if args.skip is not None else 3
  name = args.name if args.name != "async_vs_sync" else "async_vs_sync_lognormal"
  work = args.workdir or tempfile.mkdtemp(prefix="async_vs_sync_lognormal_")
  os.makedirs(work, exist_ok=True)
  py, t0 = sys.executable, time.time()
  shape = workload_flags(workload, args.slots)
  print(f"[async_vs_sync] workload {workload.spec}; warm start in {work}", flush=True)
  run_logged([py, "-m", "asyncrl_jax.sft", f"--config={CONFIG}", f"--workdir={work}",
              f"--config.learner.warm_start_steps={args.warm_start_steps}", *shape, *args.override],
             os.path.join(work, "sft.log"))
  common = [f"--config.model.hf_path={os.path.join(work, 'warm_start')}", f"--config.steps={steps}",
            f"--config.learner.eval_every={10 * steps}", f"--config.checkpoint.every_steps={10 * steps}",
            "--config.data.eval_problems=32", *shape, *args.override]
  print(f"[async_vs_sync] each role's rate alone ({time.time() - t0:.0f}s so far)", flush=True)
  from configs import default  # pylint: disable=import-outside-toplevel
  # the batch: the config's, unless an override sets it
  slots, batch = args.slots, default.get_config().learner.batch_size
  for flag in args.override:
    if flag.startswith("--config.learner.batch_size="):
      batch = int(flag.split("=", 1)[1])
  rates = measure_rates(py, common, slots, cores, os.path.join(work, "rates.log"))
  predicted = workload_predictions(rates, workload, slots=slots, batch=batch, cores=len(cores), etas=etas)
  arms = {}
  # the interruptible-generation ablation at eta 2: finish in-flight sequences on the old weights
  # before switching (AReaL's non-interruptible baseline), or keep the old weights' KV cache
  modes = [] if args.quick else ["drain", "keep_cache"]
  for label in [COLOCATED] + [str(e) for e in etas] + [f"2 {m}" for m in modes]:
    wd = os.path.join(work, label.replace(" ", "_"))
    print(f"[async_vs_sync] {label}: {steps} policy versions ({time.time() - t0:.0f}s so far)", flush=True)
    eta = 0 if label == COLOCATED else int(label.split()[0])
    flags = [f"--config.rl.max_staleness={eta}", *common]
    if " " in label and label != COLOCATED:
      flags.append(f"--config.rollout.on_weight_update={label.split()[1]}")
    if args.profile is not None and args.profile == label.replace(" ", "_"):
      flags += [f"--config.learner.profile_start={skip}", "--config.learner.profile_versions=3"]
    if label == COLOCATED:
      run_colocated_arm(py, flags, wd, os.path.join(work, "colocated.log"), cores)
    else:
      run_split_arm(py, flags, wd, os.path.join(work, f"eta{label.replace(' ', '_')}"), cores)
    arms[label] = window_metrics(_records(os.path.join(wd, "metrics.jsonl")), skip)
    arms[label].update(eta=eta, predicted=predicted["arms"].get(label))  # (none for the ablation arms)
  return _write_workload(args, name, arms, predicted, rates, workload, dict(
      steps=steps, skip=skip, etas=etas, slots=slots, batch=batch, cores=list(cores), t0=t0))


def _write_workload(args, name, arms, predicted, rates, workload, run) -> int:
  sync = arms[COLOCATED]
  for a in arms.values():
    a["ratio_vs_colocated"] = a["tokens_per_s"] / sync["tokens_per_s"]
    a["measured_over_predicted"] = (a["tokens_per_s"] / a["predicted"]["tokens_per_s"]
                                    if a["predicted"] else None)
  pred_ratio = predicted["arms"]["2"]["tokens_per_s"] / predicted["arms"][COLOCATED]["tokens_per_s"]
  result = dict(
      machine=machine(), config=dict(config=os.path.relpath(CONFIG, ROOT), workload=workload.spec,
                                      steps=run["steps"], skip=run["skip"], etas=run["etas"],
                                      slots=run["slots"], batch=run["batch"], cores=run["cores"],
                                      warm_start_steps=args.warm_start_steps, overrides=args.override),
      arms=arms, rates=rates, predicted=predicted, workload=workload.spec,
      sync_tokens_per_s=sync["tokens_per_s"], async_tokens_per_s=arms["2"]["tokens_per_s"],
      ratio=arms["2"]["tokens_per_s"] / sync["tokens_per_s"], predicted_ratio=pred_ratio,
      predicted_headroom=predicted["headroom"], slot_utilization=arms["2"]["slot_utilization"],
      seconds=time.time() - run["t0"])
  result["ratio_over_predicted"] = result["ratio"] / pred_ratio
  for mode in ("drain", "keep_cache"):
    if f"2 {mode}" in arms:  # the interruptible-generation ablation: recompute (the default) vs mode
      result[f"interrupt_gain_vs_{mode}"] = arms["2"]["tokens_per_s"] / arms[f"2 {mode}"]["tokens_per_s"] - 1
      result[f"generation_gain_vs_{mode}"] = (arms["2"]["decode_tokens_per_s"]
                                              / arms[f"2 {mode}"]["decode_tokens_per_s"] - 1)
  header = ["arm", "trained tok/s", "vs colocated", "generated tok/s", "slot util.", "learner idle",
            "max staleness", "mean staleness", "re-prefill per version (s)", "drain wait per version (s)",
            "planner tok/s", "planner slot util.", "measured / planner",
            "free-training slot util. (simulator)"]
  rows = []
  for label, a in arms.items():
    pr = a["predicted"] or {}
    rows.append([label, a["tokens_per_s"], f"{a['ratio_vs_colocated']:.2f}x", a["decode_tokens_per_s"],
                 f"{a['slot_utilization']:.1%}", f"{a['learner_idle_fraction']:.1%}",
                 a["max_staleness_seen"], f"{a['mean_staleness']:.2f}",
                 f"{a['interrupt_seconds_per_version']:.2f}", f"{a['drain_seconds_per_version']:.2f}",
                 pr.get("tokens_per_s", "-"), f"{pr['slot_utilization']:.1%}" if pr else "-",
                 f"{a['measured_over_predicted']:.2f}" if pr else "-",
                 f"{pr.get('free_training_slot_utilization', predicted['sync_slot_utilization']):.1%}"
                 if pr else "-"])
  d, lr = rates["decode"], rates["learner"]
  per_core = max(1, run["slots"] // len(run["cores"]))
  lengths = predicted["lengths"]
  notes = (
      f"The main job (configs/default.py) on the length workload `{workload.spec}`: every request "
      "generates exactly its drawn number of tokens (stop tokens banned until then; the learner applies "
      f"the same ban). Lengths: median {lengths['median']:.0f}, mean {lengths['mean']:.1f}, mean longest "
      f"of a batch {lengths['mean_longest']:.0f}, cap {workload.cap}. {run['slots']} decode slots, batch "
      f"{run['batch']}, {run['steps']} policy versions per arm (the first {run['skip']} not timed); every "
      "arm trains the same trajectories' lengths. `colocated sync`: both roles in one process on "
      f"{len(run['cores'])} cores, taking turns (eta 0); the other arms: a decode server on one core "
      "and the main job on the other. Rates measured alone before the arms (one core each): decode "
      f"step {1000 * d[run['slots']]['step_seconds']:.1f} ms at {run['slots']} slots "
      f"({d[run['slots']]['decode_tok_s']:.0f} tok/s), {1000 * d[per_core]['step_seconds']:.1f} ms at "
      f"{per_core} slots; re-prefill {d[run['slots']]['refill_steps']:.1f} decode steps per update; "
      f"learner {lr['train_tok_s']:.0f} trained tok/s. Simulator, free training: synchronous slot "
      f"utilization {predicted['sync_slot_utilization']:.1%}, headroom {predicted['headroom']:.2f}x. "
      f"Measured eta 2 / colocated sync: {result['ratio']:.2f}x; planner: {pred_ratio:.2f}x "
      f"(measured/predicted {result['ratio_over_predicted']:.2f}). " +
      ("On this machine the learner is the bottleneck: one core trains fewer tokens per second than "
       "one core's decode slots produce at the asynchronous utilization, so the prediction stays below "
       "the free-training headroom." if predicted["learner_bound"] else
       "The learner is not the bottleneck here: decoding is."))
  md = write_result(name, result, header, rows, notes, **({"out_dir": args.out} if args.out else {}))
  _plot_workload(arms, os.path.join(os.path.dirname(md), f"{name}.png"))
  print(f"[async_vs_sync] wrote {md}")
  print(json.dumps({k: result[k] for k in ("sync_tokens_per_s", "async_tokens_per_s", "ratio",
                                           "predicted_ratio", "predicted_headroom", "slot_utilization",
                                           "workload")}))
  return 0


def _plot_workload(arms: dict, path: str) -> None:
  plt = pyplot()
  split = {a["eta"]: a for label, a in arms.items() if label != COLOCATED and " " not in label}
  etas = sorted(split)
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
  ax1.plot(etas, [split[e]["tokens_per_s"] for e in etas], "o-", label="split cores, measured")
  ax1.plot(etas, [split[e]["predicted"]["tokens_per_s"] for e in etas], "s--", label="planner")
  ax1.axhline(arms[COLOCATED]["tokens_per_s"], color="gray", ls=":", label="colocated sync, measured")
  ax1.set(xlabel="max staleness eta", ylabel="trained tokens/s")
  ax1.legend(fontsize=7)
  ax2.plot(etas, [split[e]["slot_utilization"] for e in etas], "o-", label="slot utilization")
  ax2.plot(etas, [split[e]["learner_idle_fraction"] for e in etas], "s-", label="learner idle")
  ax2.axhline(arms[COLOCATED]["slot_utilization"], color="gray", ls=":", label="colocated: slot util.")
  ax2.set(xlabel="max staleness eta", ylim=(0, 1))
  ax2.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _plot(arms: dict, path: str, topology: str) -> None:
  plt = pyplot()
  plain = {a["eta"]: a for label, a in arms.items() if " " not in label}  # the recompute arms, by eta
  kept = {a["eta"]: a for label, a in arms.items() if label.endswith("keep_cache")}
  etas = sorted(plain)
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
  ax1.plot(etas, [plain[e]["tokens_per_s"] for e in etas], "o-", label="measured")
  ax1.plot(etas, [plain[e]["predicted_tokens_per_s"] for e in etas], "s--", label="planner")
  ax1.plot(etas, [plain[e]["predicted_topology_tokens_per_s"] for e in etas], "^:",
           label=f"{topology} + re-prefill")
  if kept:
    ax1.plot(sorted(kept), [kept[e]["tokens_per_s"] for e in sorted(kept)], "D", label="measured, keep_cache")
  ax1.set_xlabel("max staleness eta")
  ax1.set_ylabel("trained tokens/s")
  ax1.legend(fontsize=7)
  ax2.plot(etas, [plain[e]["slot_utilization"] for e in etas], "o-", label="decode slot utilization")
  ax2.plot(etas, [plain[e]["learner_idle_fraction"] for e in etas], "s-", label="learner idle")
  ax2.set_xlabel("max staleness eta")
  ax2.set_ylim(0, 1)
  ax2.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())

"""The pod's twin's throughput at several (learner processes P, decode servers K), side by side.

  .venv/bin/python benchmarks/twin.py [--quick] [--shapes 1x1 1x2 2x2] [--steps N] [--lora R]

Each shape runs ``launch/local.sh WORKDIR --learners P --servers K`` (1 CPU device per process) on the
main job's config, without warm start, held-out evaluation or compile warm-up, for the same number of
policy versions. Throughput is trained tokens per second over the versions after the first ``--skip``
(compilation), from each run's ``metrics.jsonl``. Beside it: the learner's mean update seconds, the
seconds it was blocked publishing weights, the slowest pull, the staleness reached, and the weight
bytes pulled from each learner process. Writes benchmarks/results/twin.{json,md,png}.

``--lora R``: each shape runs twice side by side, full-weight RL and LoRA RL (``model.lora.rank=R``,
the targets ``--lora-targets``), and the table adds the bytes of one server's pull of the full
weights and of the adapters alone (``summary.json``'s ``weight_publishes``: with LoRA a server pulls
the full weights once, then the adapters); written as ``twin_lora``.

Every process of every shape shares this machine's cores, so more processes here means more
contention, not more hardware: the table says what the twin costs on one machine, not what a pod gains.
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

from benchmarks.common import machine, pyplot, write_result  # noqa: E402  pylint: disable=wrong-import-position

FLAGS = ["--config.learner.warm_start_steps=0", "--config.learner.eval_every=0",
         "--config.rollout.warm_up=False", "--config.checkpoint.every_steps=1000"]


def run_shape(learners: int, servers: int, steps: int, workdir: str, overrides: list) -> dict:
  """One twin run; returns its summary and per-version metrics."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHON"] = sys.executable
  log_path = os.path.join(os.path.dirname(workdir), f"{os.path.basename(workdir)}.log")
  t = time.time()
  with open(log_path, "w") as log:
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "local.sh"), workdir, "--learners",
                           str(learners), "--servers", str(servers), f"--config.steps={steps}", *FLAGS,
                           *overrides], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
  if proc.returncode:
    with open(log_path) as f:
      raise RuntimeError(f"twin {learners}x{servers} exited with {proc.returncode}:\n{f.read()[-3000:]}")
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    metrics = [json.loads(line) for line in f]
  return {"summary": summary, "metrics": metrics, "seconds": time.time() - t}


def figures(run: dict, skip: int) -> dict:
  """Throughput and weight-publishing figures over the versions after the first ``skip``."""
  m = run["metrics"]
  timed = m[skip:]
  span = timed[-1]["time"] - m[skip - 1]["time"] if skip else timed[-1]["time"]
  mean = lambda k: sum(r[k] for r in timed) / len(timed)
  s = run["summary"]
  return dict(tokens_per_s=sum(r["trained_tokens"] for r in timed) / span,
              seconds_per_version=span / len(timed), learner_seconds=mean("learner_seconds"),
              publish_blocked_seconds=mean("publish_blocked_seconds"),
              transfer_seconds=mean("transfer_seconds"), max_staleness_seen=s["max_staleness_seen"],
              learner_processes=s["learner_processes"], decode_servers=s["decode_servers"],
              transfer_bytes_sent=s["transfer_bytes_sent"], wall_seconds=run["seconds"],
              weight_publishes=s.get("weight_publishes", {}))


def per_pull(publishes: dict, kind: str) -> float:
  """Mean bytes of one server's pull of ``kind`` ("full" or "partial"); nan when none happened."""
  n = publishes.get(kind, 0)
  return publishes.get(f"{kind}_bytes", 0) / n if n else float("nan")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="8 versions per shape")
  p.add_argument("--shapes", nargs="*", default=["1x1", "1x2", "2x2"], help="PxK: learners x servers")
  p.add_argument("--steps", type=int, default=None, help="policy versions per shape (default 20; quick 8)")
  p.add_argument("--skip", type=int, default=2, help="versions excluded from timing (compilation)")
  p.add_argument("--override", action="append", default=[], help="extra --config.x=y (repeatable)")
  p.add_argument("--lora", type=int, default=0, help="also run each shape with LoRA of this rank")
  p.add_argument("--lora-targets", default="q,k,v,o,gate,up,down", help="model.lora.targets for --lora")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  steps = args.steps or (8 if args.quick else 20)
  shapes = []
  for shape in args.shapes:
    try:
      learners, servers = (int(x) for x in shape.split("x"))
    except ValueError:
      p.error(f"--shapes {shape!r}: must be PxK, e.g. 2x2")
    shapes.append((learners, servers))
  if not 0 < args.skip < steps:
    p.error(f"--skip {args.skip} must lie in [1, --steps={steps})")
  arms = [("", [])]
  if args.lora:
    arms.append((f" lora{args.lora}", [f"--config.model.lora.rank={args.lora}",
                                       f"--config.model.lora.targets={args.lora_targets}"]))
  out, rows = {}, []
  with tempfile.TemporaryDirectory() as tmp:
    for learners, servers in shapes:
      for suffix, extra in arms:
        name = f"{learners}x{servers}{suffix}"
        print(f"[twin] P={learners} K={servers}{suffix}: {steps} versions", flush=True)
        f = figures(run_shape(learners, servers, steps, os.path.join(tmp, name.replace(" ", "_")),
                              args.override + extra), args.skip)
        out[name] = f
        sent = f["transfer_bytes_sent"]
        row = [name, f"{f['tokens_per_s']:.0f}", f"{f['seconds_per_version']:.2f}",
               f"{f['learner_seconds']:.2f}", f"{f['publish_blocked_seconds'] * 1e3:.0f}",
               f"{f['transfer_seconds'] * 1e3:.0f}", f["max_staleness_seen"],
               " / ".join(f"{b / 1e6:.1f}" for b in sent), f"{max(sent) / min(sent):.3f}"]
        if args.lora:
          full, part = per_pull(f["weight_publishes"], "full"), per_pull(f["weight_publishes"], "partial")
          row += [f"{full / 1e3:.1f}", f"{part / 1e3:.1f}" if part == part else "-",
                  f"{100 * part / full:.1f}%" if part == part else "-"]
        rows.append(row)
        print(f"[twin] {name}: {f}", flush=True)
  base = out.get("1x1", {}).get("tokens_per_s")
  result = dict(machine=machine(), config=dict(steps=steps, skip=args.skip, flags=FLAGS + args.override,
                                               config="configs/default.py", devices_per_process=1,
                                               lora_rank=args.lora,
                                               lora_targets=args.lora_targets if args.lora else None),
                results=out, relative_to_1x1={k: v["tokens_per_s"] / base for k, v in out.items()} if base else {})
  header = ["P x K (learner processes x decode servers)", "trained tok/s", "s / version", "learner update (s)",
            "publish blocked (ms)", "slowest pull (ms)", "max staleness", "weight MB pulled per learner process",
            "max/min"]
  if args.lora:
    header += ["kB per full pull", "kB per adapters pull", "adapters / full"]
  notes = (f"`launch/local.sh` on configs/default.py without warm start, evaluation or compile warm-up; "
           f"{steps} policy versions per shape, the first {args.skip} excluded from timing; 1 virtual CPU "
           "device per process (learner fsdp=P across the learner processes). All processes share this "
           "machine's cores: more processes is more contention here, not more hardware.")
  if args.lora:
    notes += (f" Each shape also ran with LoRA (rank {args.lora} on {args.lora_targets}): a server pulls the "
              "full weights once, then the adapters alone (the base is frozen).")
  name = "twin_lora" if args.lora else "twin"
  md = write_result(name, result, header, rows, notes, **({"out_dir": args.out} if args.out else {}))
  _plot(out, os.path.join(os.path.dirname(md), f"{name}.png"))
  return 0


def _plot(out: dict, path: str) -> None:
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(5, 3.5))
  names = list(out)
  ax.bar(names, [out[n]["tokens_per_s"] for n in names])
  ax.set_xlabel("learner processes x decode servers")
  ax.set_ylabel("trained tokens / s")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())

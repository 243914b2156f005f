"""Soak: the pod's twin (1 learner process, 2 decode servers, real processes on 127.0.0.1) trained for
``--minutes`` under random faults, then checked for loss and double training.

    python -m benchmarks.soak --minutes 10

Faults, one every ``--every`` seconds on average (uniform in [0.5, 1.5] x that), of a kind drawn at
random:

* ``server_kill``: a decode server SIGKILLed, started again 5 s later (same id, a new port);
* ``server_stall``: a decode server SIGSTOPped past the learner's deadline, then SIGCONTed (it is
  dropped, registers again on its own and rejoins);
* ``server_drain``: a decode server SIGTERMed (it drains and exits 0), started again 2 s later;
* ``learner_kill``: the learner SIGKILLed at a random moment (mid-step, mid-push or mid-save),
  started again at once: it resumes from its newest complete checkpoint and re-attaches to the
  servers that kept running.

Throughout, each decode server sends 2% of its trajectories twice (``ASYNCRL_FAULT_DUPLICATES``). At
the end the learner is preempted (SIGTERM: it saves and exits 0) and the servers drain. The report:
faults injected and survived, prompts lost and trained twice over the lineage (both must be 0), the
largest staleness any batch held, host RSS of every process at start and end, and per fault the
throughput dip (versions per second in the 30 s after it over the 60 s before) and the recovery
time (seconds until the run is 3 versions past the newest version it had reached before the fault).
Writes ``benchmarks/results/soak.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

from benchmarks import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("server_kill", "server_stall", "server_drain", "learner_kill")
DEADLINE = 5.0  # rollout.server_deadline
OVERRIDES = ["--config.data.num_train=2000", "--config.data.num_test=20", "--config.learner.batch_size=8",
             "--config.rl.group_size=4", "--config.rollout.num_slots=8",
             "--config.data.max_completion_len=24", "--config.checkpoint.every_steps=5",
             "--config.learner.token_budget=512", "--config.learner.warm_start_steps=0",
             "--config.learner.eval_every=0", "--config.rl.max_staleness=2", "--config.steps=100000",
             "--config.rollout.register_interval=1", f"--config.rollout.server_deadline={DEADLINE:g}",
             "--config.rollout.drain_timeout=10", "--config.rollout.push_timeout=120"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
  try:
    with open(f"/proc/{pid}/status") as f:
      return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024
  except (OSError, StopIteration):
    return float("nan")


class Twin:
  """The learner and decode-server processes of one soak, started and faulted by name."""

  def __init__(self, workdir: str, port: int, servers: int = 2):
    self.workdir, self.port, self.servers = workdir, port, servers
    self.env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    self.env.update(XLA_FLAGS="--xla_force_host_platform_device_count=1", ASYNCRL_CPU_DEVICES="1",
                    PYTHONUNBUFFERED="1")
    self.learner = None
    self.decode: dict[int, subprocess.Popen] = {}
    self.starts = 0
    os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)

  def _log(self, name: str):
    return open(os.path.join(self.workdir, "logs", f"{name}.log"), "a")

  def start_learner(self) -> None:
    self.starts += 1
    self.learner = subprocess.Popen(
        [sys.executable, "-m", "asyncrl_jax.train", f"--config={ROOT}/configs/default.py",
         f"--workdir={self.workdir}", f"--config.rollout.servers={self.servers}",
         f"--config.rollout.registry_port={self.port}", *OVERRIDES],
        cwd=ROOT, env=self.env, stdout=self._log("learner"), stderr=subprocess.STDOUT)

  def start_server(self, i: int) -> None:
    self.decode[i] = subprocess.Popen(
        [sys.executable, "-m", "asyncrl_jax.rollout.main", f"--config={ROOT}/configs/default.py",
         f"--server_id=decode-{i}", f"--config.rollout.learner_address=127.0.0.1:{self.port}",
         *OVERRIDES], cwd=ROOT, env=dict(self.env, ASYNCRL_FAULT_DUPLICATES="0.02"),
        stdout=self._log(f"decode-{i}"), stderr=subprocess.STDOUT)

  def versions(self) -> int:
    path = os.path.join(self.workdir, "metrics.jsonl")
    if not os.path.exists(path):
      return 0
    with open(path) as f:
      return sum(1 for l in f if l.endswith("\n") and l.strip())

  def rss(self) -> dict:
    out = {"learner": _rss_mb(self.learner.pid)}
    out.update({f"decode-{i}": _rss_mb(p.pid) for i, p in self.decode.items()})
    return out

  def check_alive(self) -> None:
    if self.learner.poll() is not None:
      raise RuntimeError(f"the learner exited ({self.learner.returncode}) on its own; see "
                         f"{self.workdir}/logs/learner.log")

  def stop(self) -> None:
    for p in [self.learner, *self.decode.values()]:
      if p is not None and p.poll() is None:
        p.kill()


def _rate(progress, t0: float, t1: float) -> float:
  """Versions per second between times ``t0`` and ``t1`` (the newest version reached, so a
  learner's restart counts as no progress until it is past where it was)."""
  def at(t):
    seen = [v for s, v in progress if s <= t]
    return max(seen, default=0)
  return (at(t1) - at(t0)) / max(t1 - t0, 1e-9)


def fault_effects(progress, fault_time: float, *, before: float = 60.0, after: float = 30.0,
                  versions_past: int = 3) -> dict:
  """A fault's throughput dip and recovery from ``progress`` ((time, versions trained) samples):
  ``dip`` = the rate in the ``after`` seconds after the fault over the rate in the ``before``
  seconds before it; ``recovery_s`` = seconds until the count is ``versions_past`` versions past the
  highest count reached before the fault (None: never, within the samples)."""
  high = max((v for t, v in progress if t <= fault_time), default=0)
  base = _rate(progress, fault_time - before, fault_time)
  dip = _rate(progress, fault_time, fault_time + after) / base if base > 0 else float("nan")
  back = next((t for t, v in progress if t > fault_time and v >= high + versions_past), None)
  return {"dip": dip, "recovery_s": None if back is None else back - fault_time}


def lineage(workdir: str, per_batch: int) -> dict:
  """Loss and double training over the run's final lineage (``trained_prompts.jsonl``)."""
  with open(os.path.join(workdir, "trained_prompts.jsonl")) as f:
    records = [json.loads(l) for l in f if l.strip()]
  versions = [r["version"] for r in records]
  prompts = [i for r in records for i in r["prompts"]]
  ids = [i for r in records for i in r["trajectory_ids"]]
  expected = set(range(len(records) * per_batch))
  return {"versions": len(records), "versions_in_order": versions == list(range(len(records))),
          "prompts_lost": len(expected - set(prompts)),
          "prompts_trained_twice": len(prompts) - len(set(prompts)),
          "trajectories_trained_twice": len(ids) - len(set(ids))}


def soak(minutes: float, every: float, seed: int, workdir: str) -> dict:
  rng = random.Random(seed)
  twin = Twin(workdir, _free_port())
  twin.start_learner()
  for i in range(twin.servers):
    twin.start_server(i)
  progress, faults, rss_start = [], [], None
  t_start = time.time()
  try:
    while twin.versions() < 5:  # warm: faults start once the run trains
      twin.check_alive()
      if time.time() - t_start > 600:
        raise RuntimeError("the soak's run did not reach version 5 within 600 s")
      time.sleep(0.5)
    rss_start = twin.rss()
    t0 = time.time()
    next_fault = t0 + every * rng.uniform(0.5, 1.5)
    pending = []  # (when, action)
    while time.time() - t0 < minutes * 60:
      now = time.time()
      progress.append((now - t0, twin.versions()))
      for when, action in [p for p in pending if p[0] <= now]:
        pending.remove((when, action))
        action()
      if now >= next_fault and not pending:
        kind = rng.choice(KINDS)
        target = "learner" if kind == "learner_kill" else f"decode-{rng.randrange(twin.servers)}"
        faults.append({"kind": kind, "target": target, "time": now - t0, "version": twin.versions()})
        print(f"[soak] {now - t0:6.1f}s  {kind} {target} at version {twin.versions()}", flush=True)
        if kind == "learner_kill":
          twin.learner.kill()
          twin.learner.wait()
          twin.start_learner()
        else:
          i = int(target.split("-")[1])
          proc = twin.decode[i]
          if kind == "server_kill":
            proc.kill()
            pending.append((now + 5, lambda i=i: twin.start_server(i)))
          elif kind == "server_stall":
            proc.send_signal(signal.SIGSTOP)
            pending.append((now + DEADLINE + 3, lambda p=proc: p.send_signal(signal.SIGCONT)))
          else:
            proc.send_signal(signal.SIGTERM)
            pending.append((now + 2, lambda i=i, p=proc: (p.wait(60), twin.start_server(i))))
        next_fault = now + every * rng.uniform(0.5, 1.5)
      twin.check_alive()
      time.sleep(0.5)
    rss_end = twin.rss()
    for p in twin.decode.values():  # (a stall under way ends; a restart still pending is not made)
      if p.poll() is None:
        p.send_signal(signal.SIGCONT)
    # the end: a preemption notice to the learner (it saves and exits 0), then the servers drain
    twin.learner.send_signal(signal.SIGTERM)
    learner_rc = twin.learner.wait(120)
    server_rcs = {}
    for i, p in twin.decode.items():
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)
      server_rcs[f"decode-{i}"] = p.wait(60)
  finally:
    twin.stop()
  for f in faults:
    f.update(fault_effects(progress, f["time"]))
    f["survived"] = f["recovery_s"] is not None
  duplicated = 0
  for i in range(twin.servers):
    with open(os.path.join(workdir, "logs", f"decode-{i}.log")) as fh:
      duplicated += sum(int(l.split("sent ")[1].split()[0]) for l in fh if "trajectories twice" in l)
  with open(os.path.join(workdir, "metrics.jsonl")) as fh:
    metrics = [json.loads(l) for l in fh if l.strip()]
  return {"minutes": minutes, "faults": faults, "progress": progress, "learner_starts": twin.starts,
          "lineage": lineage(workdir, per_batch=2), "duplicated_deliveries": duplicated,
          "max_staleness_seen": max((m["max_staleness_seen"] for m in metrics), default=0),
          "max_staleness": 2, "rss_mb_start": rss_start, "rss_mb_end": rss_end,
          "learner_exit_on_sigterm": learner_rc, "server_exits_on_sigterm": server_rcs}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--minutes", type=float, default=10.0)
  ap.add_argument("--every", type=float, default=60.0, help="mean seconds between faults")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--workdir", default="", help="default: a new temporary directory")
  ap.add_argument("--out", default=common.RESULTS_DIR)
  args = ap.parse_args()
  workdir = args.workdir or tempfile.mkdtemp(prefix="soak-")
  print(f"[soak] {args.minutes:g} minutes, a fault every ~{args.every:g}s, workdir {workdir}", flush=True)
  r = soak(args.minutes, args.every, args.seed, workdir)
  r.update(machine=common.machine(), config={"overrides": OVERRIDES, "every": args.every,
                                             "seed": args.seed, "servers": 2, "learner_processes": 1})
  kinds = {k: sum(f["kind"] == k for f in r["faults"]) for k in KINDS}
  survived = sum(f["survived"] for f in r["faults"])
  lin = r["lineage"]
  notes = (f"`python -m benchmarks.soak --minutes {args.minutes:g}`: {len(r['faults'])} faults injected "
           f"({', '.join(f'{n} {k}' for k, n in kinds.items())}), {survived} survived (the run was 3 "
           f"versions past its pre-fault high afterwards). {lin['versions']} versions trained over "
           f"{r['learner_starts']} learner starts; prompts lost {lin['prompts_lost']}, prompts "
           f"trained twice {lin['prompts_trained_twice']}, trajectories trained twice "
           f"{lin['trajectories_trained_twice']}, versions in order: {lin['versions_in_order']}; "
           f"{r['duplicated_deliveries']} deliveries duplicated on purpose. Max staleness seen "
           f"{r['max_staleness_seen']} (bound {r['max_staleness']}). Host RSS MB at start -> end: "
           + ", ".join(f"{k} {r['rss_mb_start'][k]:.0f} -> {r['rss_mb_end'].get(k, float('nan')):.0f}"
                       for k in r["rss_mb_start"])
           + f". On the final SIGTERM the learner exited {r['learner_exit_on_sigterm']}, the servers "
           f"{r['server_exits_on_sigterm']}. A decode server's RSS at the end is its latest process's "
           "(a killed one was started again). Dip: versions/s in the 30 s after a fault over the 60 s "
           "before; recovery: seconds until 3 versions past the pre-fault high.")
  rows = [[f"{f['time']:.0f}", f["kind"], f["target"], f["version"], f["dip"],
           "never" if f["recovery_s"] is None else f"{f['recovery_s']:.1f}"] for f in r["faults"]]
  path = common.write_result("soak", r, ["t (s)", "fault", "target", "at version", "dip", "recovery (s)"],
                             rows, notes=notes, out_dir=args.out)
  plt = common.pyplot()
  fig, ax = plt.subplots(figsize=(9, 4))
  ts, vs = zip(*r["progress"]) if r["progress"] else ((), ())
  ax.plot(ts, vs, lw=1.2, label="versions in metrics.jsonl")
  colors = dict(zip(KINDS, ("tab:red", "tab:orange", "tab:green", "tab:purple")))
  for k in KINDS:
    xs = [f["time"] for f in r["faults"] if f["kind"] == k]
    for x in xs:
      ax.axvline(x, color=colors[k], lw=0.8, ls="--")
    ax.plot([], [], color=colors[k], ls="--", label=k)
  ax.set_xlabel("seconds"), ax.set_ylabel("policy versions"), ax.legend(fontsize=8)
  ax.set_title("soak: training progress under random faults")
  fig.tight_layout()
  fig.savefig(os.path.join(args.out, "soak.png"), dpi=110)
  print(notes)
  print(f"wrote {path}")
  ok = survived == len(r["faults"]) and lin["prompts_lost"] == lin["prompts_trained_twice"] == 0 \
      and lin["trajectories_trained_twice"] == 0 and lin["versions_in_order"]
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()

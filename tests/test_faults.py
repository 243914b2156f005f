"""Faults injected into real processes on 127.0.0.1 (the pod's twin, ``launch/local.sh``), each run
bounded in time: decode servers killed, restarted and stalled while the learner trains."""

import json
import os
import signal
import subprocess
import sys
import time

from tests.test_train import ROOT, TWIN, _env


def _versions(workdir) -> int:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for l in f if l.endswith("\n") and l.strip())


def _wait_version(proc, workdir, version: int, timeout: float = 240.0) -> None:
  deadline = time.time() + timeout
  while _versions(workdir) < version:
    assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before version {version}"
    assert time.time() < deadline, f"no version {version} within {timeout:.0f}s"
    time.sleep(0.2)


def _wait_log(proc, path, text: str, timeout: float = 240.0) -> None:
  deadline = time.time() + timeout
  while not (path.exists() and text in path.read_text()):
    assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {path} said {text!r}"
    assert time.time() < deadline, f"{path} did not say {text!r} within {timeout:.0f}s"
    time.sleep(0.2)


def _pid(workdir, i: int) -> int:
  with open(os.path.join(workdir, "servers", f"pid-{i}")) as f:
    return int(f.read())


def _start_server(workdir, i: int, *overrides) -> subprocess.Popen:
  """Decode server ``decode-i`` again, the way ``launch/local.sh`` starts it."""
  with open(os.path.join(workdir, "registry_address")) as f:
    registry = f.read().strip()
  env = dict(_env(), XLA_FLAGS="--xla_force_host_platform_device_count=1", ASYNCRL_CPU_DEVICES="1")
  log = open(os.path.join(workdir, "servers", f"decode-{i}-restarted.log"), "w")
  return subprocess.Popen(
      [sys.executable, "-m", "asyncrl_jax.rollout.main", f"--config={ROOT}/configs/default.py",
       f"--server_id=decode-{i}", f"--port_file={workdir}/servers/port-{i}-restarted",
       f"--config.rollout.learner_address={registry}", *overrides], cwd=ROOT, env=env, stdout=log,
      stderr=subprocess.STDOUT)


def _dump_stacks(workdir) -> None:
  """Every thread's stack of the run's processes (``kill -USR1``) into their logs, then prints the
  learner's: what a stuck run was waiting for."""
  for pid in subprocess.run(["pgrep", "-f", f"workdir={workdir}"], capture_output=True,
                            text=True).stdout.split():
    os.kill(int(pid), signal.SIGUSR1)
  time.sleep(2)
  print((workdir / "learner-0.log").read_text()[-20000:])


def test_decode_servers_killed_restarted_and_stalled_the_run_goes_on(tmp_path):
  """K=2 decode servers. At version 2 decode-0 is SIGKILLed; the learner drops it within the server
  deadline and trains on decode-1 alone. decode-0 is started again (a new port) and rejoins: it is
  sent the current weights before it gets work. Two versions later decode-1 is SIGSTOPped: weight pushes
  stop waiting for it after the deadline, and the run finishes on decode-0. Nothing is lost or trained
  twice: one record per version, each version's prompts once, the staleness bound held."""
  steps = 40  # (on one server the versions come fast: room for the restart to join in time)
  overrides = [f"--config.steps={steps}", *TWIN, "--config.rollout.server_deadline=3",
               "--config.rollout.push_timeout=120"]
  learner_log = open(tmp_path / "learner-0.log", "w")
  proc = subprocess.Popen(["bash", f"{ROOT}/launch/local.sh", str(tmp_path), "--learners", "1",
                           "--servers", "2", *overrides], cwd=ROOT, env=dict(_env(), PYTHON=sys.executable),
                          stdout=learner_log, stderr=subprocess.STDOUT, text=True)
  restarted = stalled = None
  try:
    _wait_version(proc, tmp_path, 2)
    os.kill(_pid(tmp_path, 0), signal.SIGKILL)
    _wait_version(proc, tmp_path, 3)
    restarted = _start_server(tmp_path, 0, *overrides)
    _wait_log(proc, tmp_path / "servers" / "decode-0-restarted.log", "pulled weights v")
    joined = _versions(tmp_path)
    _wait_version(proc, tmp_path, joined + 2)
    stalled = _pid(tmp_path, 1)
    os.kill(stalled, signal.SIGSTOP)
    proc.wait(timeout=300)
  except BaseException:
    _dump_stacks(tmp_path)
    raise
  finally:
    if stalled is not None:
      try:
        os.kill(stalled, signal.SIGCONT)
      except ProcessLookupError:  # (local.sh stopped it with the run)
        pass
    if proc.poll() is None:  # SIGTERM: local.sh's trap stops every process it started
      proc.terminate()
      try:
        proc.wait(30)
      except subprocess.TimeoutExpired:
        proc.kill()
    if restarted is not None:
      restarted.terminate()
      restarted.wait(30)
  out = (tmp_path / "learner-0.log").read_text()
  assert proc.returncode == 0, out[-4000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  prompts = [json.loads(l) for l in (tmp_path / "trained_prompts.jsonl").read_text().splitlines()]
  assert summary["steps"] == steps and [m["version"] for m in metrics] == list(range(1, steps + 1))
  assert [p["version"] for p in prompts] == list(range(steps))
  # no prompt lost or trained twice: the stream's first 2 x steps prompts, each once, in order
  assert [i for p in prompts for i in sorted(p["prompts"])] == list(range(2 * steps))
  assert summary["max_staleness_seen"] <= 1
  events = [(e["event"], e["server_id"]) for e in summary["decode_server_events"]]
  assert events == [("servers_lost", "decode-0"), ("servers_joined", "decode-0"),
                    ("servers_lost", "decode-1")], summary["decode_server_events"]
  details = [e["detail"] for e in summary["decode_server_events"]]
  # killed: found by its failed pulls or its silence, whichever comes first; stalled: silence
  assert "no answer for 3s" in details[0] or "failed pulls" in details[0], details[0]
  assert "no answer for 3s" in details[2] or "did not pull" in details[2], details[2]
  # the rejoined server pulled the current weights, then decoded: the last versions came from it
  log = (tmp_path / "servers" / "decode-0-restarted.log").read_text()
  assert "registered with the learner" in log and "pulled weights v" in log
  first_pull = int(log.split("pulled weights v")[1].split(":")[0])
  assert 3 <= first_pull <= joined + 1  # the current version when it joined
  assert metrics[-1]["decode_servers"] == 1 and metrics[joined + 1]["decode_servers"] == 2
  # no push held the learner for anything like push_timeout: the dead and the stalled were dropped
  assert max(m["publish_blocked_seconds"] for m in metrics) < 60

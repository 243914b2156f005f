"""Faults injected into real processes on 127.0.0.1 (the pod's twin, ``launch/local.sh``), each run
bounded in time: decode servers killed, restarted and stalled while the learner trains."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.train.test_train import ROOT, TWIN, _env, _trained_prompts


def _free_port() -> int:
  import socket  # pylint: disable=import-outside-toplevel
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


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


@pytest.mark.slow(41)
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
  # killed: found by its failed pulls, its silence, or its restart registering again under its id,
  # whichever comes first; stalled: silence
  assert any(k in details[0] for k in ("no answer for 3s", "failed pulls", "registered again")), \
      details[0]
  assert "no answer for 3s" in details[2] or "did not pull" in details[2], details[2]
  # the rejoined server pulled the current weights, then decoded: the last versions came from it
  log = (tmp_path / "servers" / "decode-0-restarted.log").read_text()
  assert "registered with the learner" in log and "pulled weights v" in log
  first_pull = int(log.split("pulled weights v")[1].split(":")[0])
  assert 3 <= first_pull <= joined + 1  # the current version when it joined
  assert metrics[-1]["decode_servers"] == 1 and metrics[joined + 1]["decode_servers"] == 2
  # no push held the learner for anything like push_timeout: the dead and the stalled were dropped
  assert max(m["publish_blocked_seconds"] for m in metrics) < 60


@pytest.mark.slow(27)
def test_a_restarted_learner_reattaches_to_running_decode_servers_and_a_draining_one_leaves(tmp_path):
  """The learner (remote decode servers, a fixed registry port) is SIGKILLed mid-weight-push
  (``push@5``; checkpoints every 2 versions) while both decode servers keep running. Started again,
  it resumes from its newest complete checkpoint, and the servers, which registered again on their own, take its
  weights at that older version and drop the dead learner's work. Later decode-1 gets SIGTERM: it
  gives its work back, finishes what is in flight, and exits 0; the run ends on decode-0. Over the
  lineage every version and every prompt is trained once."""
  steps, killed = 14, 5
  port = _free_port()
  common = [*TWIN, f"--config.steps={steps}", "--config.checkpoint.every_steps=2",
            "--config.rollout.register_interval=1", "--config.rollout.drain_timeout=10",
            "--config.rollout.server_deadline=5"]
  env1 = dict(_env(), PYTHONUNBUFFERED="1", XLA_FLAGS="--xla_force_host_platform_device_count=1",
              ASYNCRL_CPU_DEVICES="1")
  (tmp_path / "servers").mkdir()

  def learner(name, fault=""):
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "asyncrl_jax.train", f"--config={ROOT}/configs/default.py",
         f"--workdir={tmp_path}", "--config.rollout.servers=2", f"--config.rollout.registry_port={port}",
         *common], cwd=ROOT, env=dict(env1, **({"ASYNCRL_FAULT": fault} if fault else {})), stdout=log,
        stderr=subprocess.STDOUT)

  def server(i):
    log = open(tmp_path / "servers" / f"decode-{i}.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "asyncrl_jax.rollout.main", f"--config={ROOT}/configs/default.py",
         f"--server_id=decode-{i}", f"--config.rollout.learner_address=127.0.0.1:{port}", *common],
        cwd=ROOT, env=env1, stdout=log, stderr=subprocess.STDOUT)

  first = learner("learner-a", fault=f"push@{killed}")
  servers = [server(0), server(1)]
  second = None
  try:
    first.wait(timeout=300)
    assert first.returncode == -signal.SIGKILL, (tmp_path / "learner-a.log").read_text()[-3000:]
    assert all(p.poll() is None for p in servers), "a decode server died with the learner"
    second = learner("learner-b")
    _wait_log(second, tmp_path / "learner-b.log", "resumed from checkpoint")
    restored = int((tmp_path / "learner-b.log").read_text().split(
        "resumed from checkpoint at policy version ")[1].split()[0])
    _wait_version(second, tmp_path, restored + 4)
    t = time.time()
    servers[1].send_signal(signal.SIGTERM)
    servers[1].wait(timeout=60)
    drained_in = time.time() - t
    second.wait(timeout=300)
  except BaseException:
    _dump_stacks(tmp_path)
    raise
  finally:
    for p in [first, second, *servers]:
      if p is not None and p.poll() is None:
        p.terminate()
        try:
          p.wait(30)
        except subprocess.TimeoutExpired:
          p.kill()
  out = (tmp_path / "learner-b.log").read_text()
  assert second.returncode == 0, out[-4000:]
  assert 2 <= restored <= killed and restored % 2 == 0, restored
  assert servers[1].returncode == 0 and drained_in < 10 + 15, drained_in
  assert servers[0].returncode == 0  # (SIGTERM at the end, idle: drained at once)
  for i in (0, 1):  # each took the new learner's weights at the older, restored version
    log = (tmp_path / "servers" / f"decode-{i}.log").read_text()
    assert "registered with a new learner" in log, log[-3000:]
    assert f"its work is dropped; serving v{restored}" in log, log[-3000:]
  assert "drained in" in (tmp_path / "servers" / "decode-1.log").read_text()
  summary = json.loads((tmp_path / "summary.json").read_text())
  events = [(e["event"], e["server_id"]) for e in summary["decode_server_events"]]
  assert events == [("servers_drained", "decode-1")], summary["decode_server_events"]
  assert summary["max_staleness_seen"] <= 1
  got = _trained_prompts(tmp_path)
  assert [r["version"] for r in got] == list(range(steps))
  assert [i for r in got for i in sorted(r["prompts"])] == list(range(2 * steps))
  ids = [i for r in got for i in r["trajectory_ids"]]
  assert len(ids) == len(set(ids)) == steps * 8
  metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [m["version"] for m in metrics] == list(range(1, steps + 1))

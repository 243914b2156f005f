"""The main job end to end on a tiny configuration: summary, staleness bound, colocated eta=0, kill
and resume."""

import collections
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--config.learner.warm_start_steps=2", "--config.data.num_train=300", "--config.data.num_test=20",
        "--config.data.eval_problems=12", "--config.data.final_eval_problems=0",
        "--config.learner.batch_size=16", "--config.rl.group_size=4",
        "--config.rollout.num_slots=12", "--config.data.max_completion_len=24",
        "--config.learner.eval_every=2", "--config.checkpoint.every_steps=2",
        "--config.learner.token_budget=1024", "--config.learner.warm_up=False"]


def _cmd(workdir, *overrides):
  return [sys.executable, "-m", "asyncrl_jax.train", f"--config={ROOT}/configs/default.py",
          f"--workdir={workdir}", *TINY, *overrides]


def _env():
  return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _run(workdir, *overrides, timeout=400):
  out = subprocess.run(_cmd(workdir, *overrides), capture_output=True, text=True, cwd=ROOT,
                       timeout=timeout, env=_env())
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out


def _complete_lines(path):
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for l in f if l.endswith("\n") and l.strip())


def _trained_prompts(workdir):
  with open(os.path.join(workdir, "trained_prompts.jsonl")) as f:
    return [json.loads(l) for l in f if l.strip()]


@pytest.mark.slow(43)
def test_async_run_end_to_end(tmp_path):
  out = _run(tmp_path, "--config.steps=4", "--config.rl.max_staleness=2",
             "--config.learner.profile_start=1", "--config.learner.profile_versions=2")
  summary = json.loads((tmp_path / "summary.json").read_text())
  traces = list((tmp_path / "profile").rglob("*.xplane.pb"))  # versions 1-2 traced (learner.profile_*)
  assert len(traces) == 1 and traces[0].stat().st_size > 1000, traces
  assert list((tmp_path / "profile").rglob("perfetto_trace.json.gz"))
  assert "profile of versions 1..2 written to" in out.stdout
  config = json.loads((tmp_path / "config.json").read_text())  # the run's resolved config
  assert config["rl"]["max_staleness"] == 2 and config["rollout"]["num_slots"] == 12
  for key in ("initial_eval_accuracy", "final_eval_accuracy", "trained_tokens", "wall_seconds",
              "effective_tokens_per_s", "max_staleness_seen", "max_staleness"):
    assert key in summary, key
  assert summary["steps"] == 4 and summary["trained_tokens"] > 0
  assert summary["max_staleness_seen"] <= summary["max_staleness"] == 2
  metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [m["version"] for m in metrics] == [1, 2, 3, 4]
  assert all(m["max_staleness_seen"] <= 2 for m in metrics)
  assert max(m["max_staleness_seen"] for m in metrics) >= 1  # it really ran ahead of the learner
  assert any("eval_accuracy" in m for m in metrics)
  assert (tmp_path / "progress.png").stat().st_size > 1000
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))
  assert "held-out accuracy, after RL" in out.stdout
  prompts = _trained_prompts(tmp_path)
  flat = [p for r in prompts for p in r["prompts"]]
  assert len(flat) == len(set(flat)) == 4 * 4  # 4 versions x (16 / 4) prompts, none twice
  # every trajectory's completion length is logged (the planner fits its length model to these)
  assert all(len(r["completion_lengths"]) == 16 for r in prompts)
  assert all(0 < n <= 24 for r in prompts for n in r["completion_lengths"])
  assert sum(m["trained_tokens"] for m in metrics) == sum(sum(r["completion_lengths"]) for r in prompts)
  # held-out accuracy: pass@1 over sampled completions, with greedy beside it
  assert summary["eval_metric"] == "pass@1 (4 samples, T=1)"
  for key in ("initial_eval_accuracy", "final_eval_accuracy", "initial_eval_greedy_accuracy",
              "final_eval_greedy_accuracy"):
    assert 0.0 <= summary[key] <= 1.0, key
  assert all("eval_greedy_accuracy" in m for m in metrics if "eval_accuracy" in m)
  # (in 4 short versions the decode server waits for the learner most of the time, so the figure
  # may be near 0 here; its formula is checked by hand in tests/rollout/test_decode_loop.py)
  assert 0.0 <= summary["decode_slot_utilization"] <= 1.0
  # cumulative decode counters: everything trained was decoded first
  assert metrics[-1]["decode_tokens"] >= sum(m["trained_tokens"] for m in metrics)
  assert all(a["decode_slot_steps"] <= b["decode_slot_steps"] for a, b in zip(metrics, metrics[1:]))


def _check_pinned(metrics, eta: int) -> None:
  """Every token of the batch trained at version v (record ``version`` v + 1) was sampled by version
  exactly max(0, v - eta): its oldest and newest tokens, over the whole batch, are min(v, eta) old."""
  for m in metrics:
    v = m["version"] - 1
    want = min(v, eta)
    assert m["max_staleness_seen"] == m["min_staleness_seen"] == want, (v, m["max_staleness_seen"],
                                                                        m["min_staleness_seen"])
    assert m["mean_staleness"] == want


def _fingerprint(workdir) -> tuple:
  """What a run trained, version by version: the prompts (digests), every completion's length, and
  the batch's reward, loss, KL and entropy."""
  prompts = [(p["version"], p["digests"], p["completion_lengths"]) for p in _trained_prompts(workdir)]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    metrics = [json.loads(l) for l in f if l.strip()]
  return prompts, [(m["version"], m["reward"], m["loss"], m["kl_behav"], m["entropy"]) for m in metrics]


@pytest.mark.slow(75)
def test_pinned_runs_of_one_seed_train_identical_batches_and_another_seed_does_not(tmp_path):
  """Paired staleness experiments rest on this: two pinned runs with the same seed train the same
  prompts, the same completions and reach the same losses for their first 5 versions, in one
  process; a run with another seed does not (the negative control). Tokens and prompts must match
  exactly; the batch statistics to float noise (the behaviour KL is a mean of log-prob differences
  near 0, whose last bits follow the decode batch's composition: 1.82e-14 against 1.78e-14 on a CI
  host)."""
  pinned = ["--config.steps=5", "--config.rl.staleness_mode=pinned", "--config.rl.max_staleness=2",
            "--config.learner.eval_every=0", "--config.checkpoint.every_steps=100"]
  for name, seed in (("a", 0), ("b", 0), ("c", 1)):
    _run(tmp_path / name, *pinned, f"--config.seed={seed}")
  a, b, c = (_fingerprint(tmp_path / name) for name in "abc")
  assert [v for v, _, _ in a[0]] == list(range(5))
  assert a[0] == b[0]
  flat = lambda rows: [x for row in rows for x in row]
  assert flat(a[1]) == pytest.approx(flat(b[1]), rel=1e-6, abs=1e-9)
  assert a[0] != c[0] and flat(a[1]) != pytest.approx(flat(c[1]), rel=1e-6, abs=1e-9)


@pytest.mark.slow(62)
def test_pinned_staleness_trains_every_batch_on_tokens_exactly_eta_versions_old(tmp_path):
  """rl.staleness_mode=pinned, eta 3, the seeds' naive baseline: the batch of version v holds only
  tokens of version v - 3 (version 0 for the first three), through the real decode server and
  weight transfer. The control is on the check: a batch with a token one version newer, or one of a
  version short of the bound, fails it. (A bounded run is no control: when decoding runs ahead, as
  under a loaded CI host, bounded staleness also trains every batch exactly eta versions old.)"""
  eta, steps = 3, 7
  _run(tmp_path / "pinned", f"--config.steps={steps}", "--config.rl.staleness_mode=pinned",
       f"--config.rl.max_staleness={eta}", "--config.rl.loss=ppo_recompute",
       "--config.rollout.num_slots=3", "--config.learner.eval_every=0")
  metrics = [json.loads(l) for l in (tmp_path / "pinned" / "metrics.jsonl").read_text().splitlines()]
  assert [m["version"] for m in metrics] == list(range(1, steps + 1))
  _check_pinned(metrics, eta)
  assert all("learning_rate" in m and m["kl_behav"] >= 0 for m in metrics)
  for field, value in (("min_staleness_seen", eta - 1), ("max_staleness_seen", eta - 1),
                       ("mean_staleness", eta - 0.5)):
    mixed = [dict(m) for m in metrics]
    mixed[-1][field] = value
    with pytest.raises(AssertionError):
      _check_pinned(mixed, eta)


@pytest.mark.slow(30)
def test_stop_on_alarm_saves_a_checkpoint_and_names_the_signal(tmp_path):
  """A planted collapse signature (completions of at most 4 tokens: nearly every one is cut by the length
  budget) with learner.stop_on_alarm: the run stops after version 1 with a checkpoint of it, exit 1,
  the message and the record naming the signal; the summary says so."""
  out = subprocess.run(_cmd(tmp_path, "--config.steps=6", "--config.data.max_completion_len=4",
                            "--config.monitor.window=1", "--config.learner.stop_on_alarm=True",
                            "--config.learner.eval_every=0"),
                       capture_output=True, text=True, cwd=ROOT, timeout=400, env=_env())
  assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
  assert "the health monitor stopped the run (learner.stop_on_alarm): truncated at version 1" in out.stderr
  assert "ALARM (health monitor): truncated at version 1" in out.stdout
  assert _latest_checkpoint(tmp_path) == 1
  metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert len(metrics) == 1 and metrics[0]["alarms"] == ["truncated"] and metrics[0]["truncated_frac"] > 0.5
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["steps"] == 1 and summary["stopped_on_alarm"][0].startswith("truncated at version 1")


def _latest_checkpoint(workdir):
  root = workdir / "checkpoints"
  steps = [int(p.name) for p in root.iterdir() if p.name.isdigit()] if root.exists() else []
  return max(steps, default=None)


def _start(workdir, *overrides, fault=""):
  env = dict(_env(), PYTHONUNBUFFERED="1", **({"ASYNCRL_FAULT": fault} if fault else {}))
  log = open(workdir.parent / f"{workdir.name}-{time.time():.3f}.log", "w")
  proc = subprocess.Popen(_cmd(workdir, *overrides), cwd=ROOT, env=env, stdout=log,
                          stderr=subprocess.STDOUT, text=True)
  proc.log_path = log.name
  return proc


def _wait_until(proc, condition, what: str, timeout: float = 300.0) -> None:
  deadline = time.time() + timeout
  while not condition():
    assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}: " + \
        open(proc.log_path).read()[-3000:]
    assert time.time() < deadline, f"not {what} within {timeout:.0f}s"
    time.sleep(0.05)


def _finish(proc, timeout: float = 400.0) -> str:
  proc.wait(timeout=timeout)
  return open(proc.log_path).read()


@pytest.mark.slow(44)
def test_learner_preempted_and_killed_resumes_each_time_and_trains_every_prompt_once(tmp_path):
  """One lineage of 5 starts of the main job: SIGTERM (a preemption notice) once a version past a
  checkpoint is logged, then SIGKILL mid-step (``train@v``), mid-checkpoint-save (``save@v``) and at
  a random time. SIGTERM saves the current version and exits 0 within 25 s; every start resumes
  from the newest complete checkpoint, dropping what was logged after it; over the final lineage
  every version has one metrics record and one trained-prompts record, and the prompts and
  trajectory ids are the stream's, each once."""
  steps, per_batch = 10, 4  # (batch 16 = 4 prompts x group 4)
  overrides = [f"--config.steps={steps}", "--config.rl.max_staleness=1",
               "--config.learner.eval_every=0", "--config.learner.warm_start_steps=0",
               "--config.rollout.warm_up=False"]
  run = tmp_path / "run"
  logged = lambda: _complete_lines(run / "trained_prompts.jsonl")
  resumed = []

  # 1. SIGTERM once a version past the first checkpoint is logged: save it, exit 0 within 25 s
  proc = _start(run, *overrides)
  _wait_until(proc, lambda: logged() >= 3, "version 3 was logged")
  t = time.time()
  proc.send_signal(signal.SIGTERM)
  out = _finish(proc, timeout=60)
  assert proc.returncode == 0 and time.time() - t < 25, out[-3000:]
  saved = _latest_checkpoint(run)
  assert f"SIGTERM: saving policy version {saved} of {steps}" in out and saved >= 3
  assert not (run / "summary.json").exists()  # (the summary is the finished run's)

  # 2.-4. SIGKILL mid-step, mid-save (checkpoints every 2 versions), then at a random time
  rng = np.random.default_rng(0)
  for kind in ("train", "save", "random"):
    before = _latest_checkpoint(run)
    if kind == "train":
      fault = f"train@{before + 1}"
    elif kind == "save":
      fault = f"save@{before + 2 - before % 2}"
    else:
      fault = ""
    proc = _start(run, *overrides, fault=fault)
    if kind == "random":
      _wait_until(proc, lambda: "resumed from checkpoint" in open(proc.log_path).read(), "it resumed")
      _wait_until(proc, lambda: logged() > before, "a version past the checkpoint was logged")
      time.sleep(float(rng.uniform(0, 1.5)))
      proc.kill()
    out = _finish(proc)
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    assert f"resumed from checkpoint at policy version {before}" in out
    resumed.append(before)
    if kind == "save":  # killed while writing: that step is not a checkpoint
      assert _latest_checkpoint(run) == before, sorted(p.name for p in (run / "checkpoints").iterdir())
  with open(run / "trained_prompts.jsonl", "a") as f:
    f.write('{"version": 99, "prom')  # a record cut short by the kill

  # 5. to the end
  before = _latest_checkpoint(run)
  out = _finish(_start(run, *overrides))
  assert f"resumed from checkpoint at policy version {before}" in out, out[-3000:]
  got = _trained_prompts(run)
  assert [r["version"] for r in got] == list(range(steps))  # every version once, none repeated
  for r in got:  # version v trains the stream's prompts v*P .. v*P+P-1, whichever run trained it
    assert sorted(r["prompts"]) == list(range(r["version"] * per_batch, (r["version"] + 1) * per_batch))
  ids = [i for r in got for i in r["trajectory_ids"]]
  assert len(ids) == len(set(ids)) == steps * 16
  assert set(ids) == {f"p{p}-s{j}" for p in range(steps * per_batch) for j in range(4)}
  metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  assert [m["version"] for m in metrics] == list(range(1, steps + 1))
  assert json.loads((run / "summary.json").read_text())["steps"] == steps


@pytest.mark.slow(40)
def test_value_advantages_run_end_to_end_and_resume_with_their_value_model(tmp_path):
  """SAO's single-rollout mode in the main job: groups of one, a value-pretraining version, the
  value model's figures in the metrics, and a second start that resumes the value model too."""
  value = ["--config.rl.advantage=value", "--config.rl.group_size=1", "--config.rl.loss=dis",
           "--config.rl.value_pretrain_versions=1"]
  _run(tmp_path, "--config.steps=3", *value)
  out = _run(tmp_path, "--config.steps=4", *value)
  assert "resumed from checkpoint at policy version 3" in out.stdout
  with open(tmp_path / "metrics.jsonl") as f:
    metrics = [json.loads(l) for l in f if l.strip()]
  assert [m["version"] for m in metrics] == [1, 2, 3, 4]
  assert [m["policy_trained"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]
  assert "loss" not in metrics[0] and all("loss" in m for m in metrics[1:])
  for m in metrics:  # (>= 0: after a 2-step warm start every reward may be 0, and so every value)
    assert np.isfinite(m["value_loss"]) and m["value_loss"] >= 0
  evaluated = [m for m in metrics if "eval_accuracy" in m]
  assert evaluated and all(np.isfinite(m["eval_value_explained_variance"]) for m in evaluated)
  with open(tmp_path / "checkpoints" / "4" / "state" / "_METADATA") as f:
    assert "value_opt_state" in f.read()  # the value model's optimizer state is saved with the run


@pytest.mark.slow(40)
def test_a_mixture_of_experts_policy_trains_end_to_end_with_routing_replay(tmp_path):
  """configs/moe.py, tiny: decode servers record routes, the controller checks them, the learner
  replays them and logs the router's statistics each version."""
  cmd = [sys.executable, "-m", "asyncrl_jax.train", f"--config={ROOT}/configs/moe.py",
         f"--workdir={tmp_path}", *TINY, "--config.steps=2"]
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=400, env=_env())
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  with open(tmp_path / "metrics.jsonl") as f:
    metrics = [json.loads(l) for l in f if l.strip()]
  assert [m["version"] for m in metrics] == [1, 2]
  for m in metrics:
    assert 0.0 <= m["moe_route_mismatch"] <= 1.0 and m["moe_aux_loss"] >= 1.0 - 1e-4
    assert sum(m[f"moe_load/{e}"] for e in range(8)) == pytest.approx(1.0, abs=1e-4)
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["failed_rollouts"] == 0 and not summary["rejected_rollouts"]  # every one carried routes


@pytest.mark.slow(40)
def test_the_kl_term_runs_end_to_end_and_resumes_with_its_reference(tmp_path):
  """rl.kl_coef in the main job: the reference is the policy after the warm start (the penalty is 0
  at the first version's first update and grows as the policy moves), written beside the
  checkpoints, and a second start resumes with it (the KL goes on from where it was, not from 0)."""
  # (after the tiny warm start every answer is wrong: the overlong penalty's spread of rewards is
  # what moves the policy, at a large rate)
  kl = ["--config.rl.kl_coef=0.1", "--config.learner.learning_rate=1e-2", "--config.rl.overlong_penalty_len=20"]
  _run(tmp_path, "--config.steps=3", *kl)
  marker = tmp_path / "checkpoints" / "reference.json"
  written = marker.stat().st_mtime_ns
  out = _run(tmp_path, "--config.steps=4", *kl)
  assert marker.stat().st_mtime_ns == written  # (read back at the resume, not taken afresh)
  assert "resumed from checkpoint at policy version 3" in out.stdout
  with open(tmp_path / "metrics.jsonl") as f:
    metrics = [json.loads(l) for l in f if l.strip()]
  assert [m["version"] for m in metrics] == [1, 2, 3, 4]
  kls = [m["kl_ref"] for m in metrics]
  # (version 1 trains at the reference itself; a reference taken afresh at the resume would give
  # version 4 the same ~0)
  assert kls[0] < 1e-6 and kls[2] > 1e-5 and kls[3] > 1e-5, kls
  assert all(m["kl_ref_penalty"] >= 0 for m in metrics)


@pytest.mark.slow(20)
def test_the_length_workload_runs_end_to_end_with_the_learner_applying_the_ban(tmp_path):
  """``rollout.length_workload``: every trajectory the main job trains has exactly its request's drawn
  length (stop tokens banned until then), and at version 1 (data of version 0, weights of version 0)
  the learner's log-probs equal the behaviour ones, the ban included."""
  from asyncrl_jax.data.workloads import LengthWorkload  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tokenization import ArithmeticTokenizer  # pylint: disable=import-outside-toplevel
  spec = "lognormal:median=6,sigma=0.8,cap=24"
  _run(tmp_path, "--config.steps=2", f"--config.rollout.length_workload={spec}",
       "--config.learner.eval_every=0", "--config.rollout.warm_up=False", "--config.seed=3",
       "--config.log.trajectories=3")
  w = LengthWorkload.parse(spec)
  lines = [json.loads(l) for l in (tmp_path / "trained_prompts.jsonl").read_text().splitlines()]
  assert [r["version"] for r in lines] == [0, 1]
  got, want = [], []
  for r in lines:
    for tid, n in zip(r["trajectory_ids"], r["completion_lengths"]):
      prompt, sample = tid[1:].split("-s")
      got.append(n)
      want.append(w.draw(3, int(prompt), int(sample)))
  assert got == want and len(set(got)) > 3
  metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert abs(metrics[0]["kl_behav"]) < 1e-5 and metrics[0]["max_staleness_seen"] == 0
  # log.trajectories=3: the first 3 trajectories of each version, as the learner trained them
  dumped = [json.loads(l) for l in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
  assert [d["version"] for d in dumped] == [0, 0, 0, 1, 1, 1]
  assert [d["trajectory_id"] for d in dumped] == lines[0]["trajectory_ids"][:3] + lines[1]["trajectory_ids"][:3]
  tok = ArithmeticTokenizer()
  for d in dumped:
    n = len(d["completion_tokens"])
    prompt, sample = d["trajectory_id"][1:].split("-s")
    assert n == w.draw(3, int(prompt), int(sample)) and d["action_mask"] == [1] * n
    assert len(d["versions"]) == len(d["behaviour_logprobs"]) == n and max(d["versions"]) <= d["version"]
    assert d["prompt_text"] == tok.decode(d["prompt_tokens"]) and d["completion_text"] == tok.decode(
        d["completion_tokens"])
    assert d["reward"] in (0.0, 1.0) and d["finish_reason"] == "length"
    assert all(lp <= 0 for lp in d["behaviour_logprobs"])


@pytest.mark.slow(19)
def test_a_nan_update_stops_the_run_naming_the_version_and_keeps_the_last_checkpoint(tmp_path):
  overrides = ["--config.steps=6", "--config.learner.eval_every=0", "--config.learner.warm_start_steps=0",
               "--config.rollout.warm_up=False", "--config.checkpoint.async_save=False"]
  out = subprocess.run(_cmd(tmp_path, *overrides), capture_output=True, text=True, cwd=ROOT, timeout=400,
                       env=dict(_env(), ASYNCRL_FAULT="nan@3"))
  assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
  error = out.stderr.strip().splitlines()[-1]
  assert error.startswith("error: policy version 3: non-finite") and "not applied" in error, error
  assert "Traceback" not in out.stderr
  assert _latest_checkpoint(tmp_path) == 2  # the last good state, not overwritten by a bad one
  metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [m["version"] for m in metrics] == [1, 2, 3]
  assert all(np.isfinite(m["loss"]) for m in metrics)


@pytest.mark.slow(40)
def test_colocated_synchronous_run_on_one_device(tmp_path):
  """The colocated synchronous baseline: both roles on one device, taking turns, eta 0 (naive PPO):
  every trained token is on-policy."""
  env = dict(_env(), XLA_FLAGS="--xla_force_host_platform_device_count=1")
  out = subprocess.run(_cmd(tmp_path, "--config.steps=3", "--config.mesh.colocate=True",
                            "--config.rl.max_staleness=0", "--config.rl.loss=ppo"),
                       capture_output=True, text=True, cwd=ROOT, timeout=400, env=env)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "1 cpu devices" in out.stdout and "the same devices, taking turns" in out.stdout
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["steps"] == 3 and summary["max_staleness_seen"] == 0 and summary["max_staleness"] == 0
  assert summary["devices"]["rollout"] == summary["devices"]["learner"]
  metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert len(metrics) == 3 and all(m["mean_staleness"] == 0 for m in metrics)


def test_train_rejects_bad_config(tmp_path):
  cmd = [sys.executable, "-m", "asyncrl_jax.train", f"--config={ROOT}/configs/default.py",
         f"--workdir={tmp_path}", "--config.rl.eps_clip=0"]
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert out.returncode == 2
  assert "rl.eps_clip=0" in out.stderr


TWIN = ["--config.data.num_train=300", "--config.data.num_test=20", "--config.data.final_eval_problems=0",
        "--config.learner.batch_size=8",
        "--config.rl.group_size=4", "--config.rollout.num_slots=8", "--config.data.max_completion_len=24",
        "--config.checkpoint.every_steps=5", "--config.learner.token_budget=512",
        "--config.learner.warm_start_steps=0", "--config.learner.eval_every=0",
        "--config.rollout.warm_up=False", "--config.rl.max_staleness=1", "--config.learner.warm_up=False"]


def _twin_start(workdir, learners: int, servers: int, steps: int, *overrides, env=(), flags=()):
  """``launch/local.sh`` in the background; its output goes to ``workdir``/../NAME-TIME.log."""
  log = open(workdir.parent / f"{workdir.name}-{time.time():.3f}.log", "w")
  proc = subprocess.Popen(["bash", f"{ROOT}/launch/local.sh", str(workdir), "--learners", str(learners),
                           "--servers", str(servers), *flags, f"--config.steps={steps}", *TWIN, *overrides],
                          stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                          env=dict(_env(), PYTHON=sys.executable, PYTHONUNBUFFERED="1", **dict(env)))
  proc.log_path = log.name
  return proc


def _twin_wait(proc, timeout: float = 300.0) -> str:
  try:
    proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.terminate()  # SIGTERM, not SIGKILL: local.sh's trap stops the processes it started
    proc.wait(timeout=30)
    raise AssertionError(f"the twin did not finish within {timeout:.0f} s: " + open(proc.log_path).read()[-3000:])
  return open(proc.log_path).read()


def _twin_results(workdir):
  summary = json.loads((workdir / "summary.json").read_text())
  metrics = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  return summary, metrics, _trained_prompts(workdir)


def _stream_digests(workdir, n: int) -> list:
  """The first ``n`` problems a single-process run's prompt stream yields (the twin's dataset and
  seed, from its config.json)."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.data import builder as builder_lib  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.data import pipeline  # pylint: disable=import-outside-toplevel
  config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
  builder = builder_lib.from_config(config, str(workdir))
  stream = pipeline.PromptStream(builder.as_data_source(split="train"), seed=config.seed, shard_index=0,
                                 shard_count=1)
  return [stream.next().digest for _ in range(n)]


def _model_bytes() -> int:
  """Bytes of the default config's parameters (``TWIN`` changes no model setting)."""
  import jax  # pylint: disable=import-outside-toplevel
  from configs.default import get_config  # pylint: disable=import-outside-toplevel
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  assert not any(f.startswith("--config.model.") for f in TWIN)
  leaves = jax.tree.leaves(models.abstract_params(models.config_of(get_config())))
  return sum(x.size * x.dtype.itemsize for x in leaves)


@pytest.mark.slow(90)
def test_the_pods_twin_trains_with_two_learner_processes_preempted_and_killed(tmp_path):
  """launch/local.sh with P=2 learner processes (fsdp across them) and K=2 decode servers, over three
  starts of one run of 10 versions.

  1. SIGTERM to learner process 1 (a preemption notice on one host): both processes agree on one
     version, save it, and exit 0 within 25 s.
  2. Process 1 is SIGKILLed mid-step (``train@v`` there only), with local.sh not watching: process 0
     is stopped by JAX within the heartbeat timeout (5 s here), not left hanging in a collective.
  3. To the end, from the newest complete checkpoint: weights sent shard to shard and balanced over
     the learner processes, the staleness bound held, and over the lineage every version trains the
     problems a single-process run trains, once.
  Held-out evaluation runs over both processes (at the start and every 5 versions)."""
  steps, run = 10, tmp_path / "run"
  run.mkdir()
  logged = lambda: _complete_lines(run / "metrics.jsonl")
  ckpt = ["--config.checkpoint.every_steps=2", "--config.learner.eval_every=5", "--config.data.eval_problems=8"]
  env = {"ASYNCRL_HEARTBEAT_SECONDS": "5"}

  # a fresh start warm-starts on process 0's devices and broadcasts the weights
  proc = _twin_start(run, 2, 2, steps, *ckpt, "--config.learner.warm_start_steps=3", env=env)
  _wait_until(proc, lambda: logged() >= 3, "version 3 was logged")
  t = time.time()
  os.kill(int((run / "learners" / "pid-1").read_text()), signal.SIGTERM)
  out = _twin_wait(proc, timeout=60)
  assert proc.returncode == 0 and time.time() - t < 25, out[-3000:]
  saved = _latest_checkpoint(run)
  assert f"SIGTERM: saving policy version {saved} of {steps}" in out and saved >= 3
  # (a checkpoint of 2 processes is written by both: that it is complete shows they agreed on it)
  assert "2 learner process(es)" in out and "2 decode server(s) registering at 127.0.0.1:" in out
  assert "at version 0 (over 2 learner processes)" in out  # the initial evaluation
  assert "[warm start (supervised)] 3/3 step" in out  # (a log: plain progress lines, no bar)

  (run / "learners" / "pid-1").unlink()  # (the first start's)
  proc = _twin_start(run, 2, 2, steps, *ckpt, flags=["--no-watch"],
                     env=dict(env, ASYNCRL_FAULT=f"train@{saved + 2}", ASYNCRL_FAULT_PROCESS="1"))
  _wait_until(proc, lambda: (run / "learners" / "pid-1").exists(), "learner process 1 started")
  pid1 = int((run / "learners" / "pid-1").read_text())
  _wait_until(proc, lambda: not os.path.exists(f"/proc/{pid1}") or
              open(f"/proc/{pid1}/stat").read().split()[2] == "Z", "learner process 1 died", timeout=300)
  t = time.time()
  out = _twin_wait(proc, timeout=60)
  assert proc.returncode != 0 and time.time() - t < 5 + 15, (time.time() - t, out[-3000:])
  assert f"resumed from checkpoint at policy version {saved}" in out
  # the survivor learns of its peer's death from whichever channel notices first: the coordination
  # service's heartbeat, or a collective (gloo) whose socket the dead peer closed or reset
  peer_lost = ("heartbeat timeout", "Connection reset by peer", "Connection closed by peer", "fatal errors")
  assert any(m in out for m in peer_lost), out[-3000:]

  before = _latest_checkpoint(run)
  proc = _twin_start(run, 2, 2, steps, *ckpt, env=env)
  out = _twin_wait(proc)
  assert proc.returncode == 0, out[-3000:]
  assert f"resumed from checkpoint at policy version {before}" in out
  summary, metrics, prompts = _twin_results(run)
  assert summary["steps"] == steps and summary["trained_tokens"] > 0
  assert summary["learner_processes"] == 2 and summary["decode_servers"] == 2
  assert summary["devices"]["learner"] == {"data": 1, "fsdp": 2, "expert": 1, "tensor": 1}
  sent = summary["transfer_bytes_sent"]
  assert len(sent) == 2 and max(sent) / min(sent) <= 1.25
  # in this start every server pulled every version (before..10) once: no more
  assert sum(sent) == 2 * (steps - before + 1) * _model_bytes()
  assert summary["max_staleness_seen"] <= 1
  assert 0 <= summary["initial_eval_accuracy"] <= 1 and 0 <= summary["final_eval_accuracy"] <= 1
  assert [m["version"] for m in metrics if "eval_accuracy" in m] == [5, 10]
  assert [m["version"] for m in metrics] == list(range(1, steps + 1))
  assert all(m["publish_blocked_seconds"] > 0 and m["transfer_seconds"] >= 0 for m in metrics)
  assert all(m["decode_servers"] == 2 for m in metrics)
  assert 0 < metrics[-1]["decode_tokens"] <= metrics[-1]["decode_slot_steps"]
  # one controller reads the whole prompt stream: version v trains its groups v*2 .. v*2+1
  expected = _stream_digests(run, 2 * steps)
  assert [p["version"] for p in prompts] == list(range(steps))
  for p in prompts:
    assert sorted(p["digests"]) == sorted(expected[2 * p["version"]:2 * p["version"] + 2]), p
  ids = [i for p in prompts for i in p["trajectory_ids"]]
  assert len(ids) == len(set(ids)) == steps * 8
  assert not (run / "learners" / "learner-1.log").read_text().count("Traceback")


@pytest.mark.slow(75)
def test_the_pods_twin_runs_single_rollout_value_mode_with_evaluation_and_resumes(tmp_path):
  """launch/local.sh, 2 learner processes and 1 decode server, SAO's single-rollout mode (the critic
  sharded over both processes) with held-out evaluation every 2 versions: value figures every
  version and on the held-out samples, then a second start resumes both models from version 4."""
  run = tmp_path / "run"
  run.mkdir()
  value = ["--config.rl.advantage=value", "--config.rl.group_size=1", "--config.rl.loss=dis",
           "--config.rl.value_pretrain_versions=1", "--config.learner.eval_every=2",
           "--config.data.eval_problems=8", "--config.checkpoint.every_steps=2"]
  out = _twin_wait(_twin_start(run, 2, 1, 4, *value))
  assert "at version 0 (over 2 learner processes)" in out, out[-3000:]
  summary, metrics, _ = _twin_results(run)
  assert summary["steps"] == 4 and summary["learner_processes"] == 2
  assert [m["version"] for m in metrics] == [1, 2, 3, 4]
  assert [m["policy_trained"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]  # version 1: the critic only
  assert all(np.isfinite(m["value_loss"]) and np.isfinite(m["value_explained_variance"]) for m in metrics)
  evaluated = [m for m in metrics if "eval_accuracy" in m]
  assert [m["version"] for m in evaluated] == [2, 4]
  assert all("eval_value_explained_variance" in m for m in evaluated)

  out = _twin_wait(_twin_start(run, 2, 1, 6, *value))
  assert "resumed from checkpoint at policy version 4" in out, out[-3000:]
  summary, metrics, _ = _twin_results(run)
  assert summary["steps"] == 6 and [m["version"] for m in metrics] == [1, 2, 3, 4, 5, 6]
  assert [m["version"] for m in metrics if "eval_value_explained_variance" in m] == [2, 4, 6]
  assert not (run / "learners" / "learner-1.log").read_text().count("Traceback")


@pytest.mark.slow(27)
def test_the_pods_twin_pins_staleness_with_a_decode_server_process(tmp_path):
  """Pinned staleness across processes (launch/local.sh: a learner and a decode-server process,
  weights pulled over the transfer server): every batch's tokens are exactly eta versions old."""
  run = tmp_path / "run"
  run.mkdir()
  eta, steps = 2, 6
  out = _twin_wait(_twin_start(run, 1, 1, steps, "--config.rl.staleness_mode=pinned",
                               f"--config.rl.max_staleness={eta}", "--config.rl.loss=ppo_recompute"))
  summary, metrics, _ = _twin_results(run)
  assert summary["steps"] == steps and summary["decode_servers"] == 1, out[-3000:]
  assert summary["decode_server_sandboxes"] == {}  # (the arithmetic task runs no model code)
  _check_pinned(metrics, eta)


@pytest.mark.slow(140)
def test_pinned_runs_of_one_seed_train_identical_batches_with_two_decode_server_processes(tmp_path):
  """The same with a learner and two decode-server processes (launch/local.sh): which server takes
  which request, and in which order they arrive, varies from run to run; every batch is the same
  anyway (sampling keys come from the request ids), and another seed's is not."""
  pinned = ("--config.rl.staleness_mode=pinned", "--config.rl.max_staleness=1")
  runs = {}
  for name, seed in (("a", 0), ("b", 0), ("c", 1)):
    run = tmp_path / name
    run.mkdir()
    out = _twin_wait(_twin_start(run, 1, 2, 5, *pinned, f"--config.seed={seed}", "--config.log.trajectories=64"))
    summary, metrics, _ = _twin_results(run)
    assert summary["steps"] == 5 and summary["decode_servers"] == 2, out[-3000:]
    _check_pinned(metrics, 1)
    served = [json.loads(l)["server_id"] for l in (run / "trajectories.jsonl").read_text().splitlines()]
    assert len(set(served)) == 2, collections.Counter(served)  # both servers sampled trained tokens
    runs[name] = _fingerprint(run)
  a, b, c = runs["a"], runs["b"], runs["c"]
  assert [v for v, _, _ in a[0]] == list(range(5))
  assert a[0] == b[0]
  flat = lambda rows: [x for row in rows for x in row]
  assert flat(a[1]) == pytest.approx(flat(b[1]), rel=1e-6, abs=1e-9)
  assert a[0] != c[0] and flat(a[1]) != pytest.approx(flat(c[1]), rel=1e-6, abs=1e-9)


@pytest.mark.slow(17)
def test_sft_cli_warm_start_then_timed_supervised_continuation(tmp_path):
  sft = [sys.executable, "-m", "asyncrl_jax.sft", f"--config={ROOT}/configs/default.py", *TINY[1:5]]
  out = subprocess.run(sft + [f"--workdir={tmp_path / 'a'}", "--config.learner.warm_start_steps=3"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, env=_env())
  assert out.returncode == 0, out.stderr[-3000:]
  first = json.loads((tmp_path / "a" / "sft_summary.json").read_text())
  assert first["steps"] == 3 and first["init"] == "random" and "initial_eval_accuracy" not in first
  ws = tmp_path / "a" / "warm_start"
  out = subprocess.run(sft + [f"--workdir={tmp_path / 'b'}", f"--config.model.hf_path={ws}",
                              "--config.learner.warm_start_steps=100000", "--schedule=constant",
                              "--max_seconds=3", "--evaluate", "--config.data.final_eval_problems=16",
                              "--config.data.final_eval_samples=2"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, env=_env())
  assert out.returncode == 0, out.stderr[-3000:]
  second = json.loads((tmp_path / "b" / "sft_summary.json").read_text())
  assert second["init"] == str(ws) and second["schedule"] == "constant"
  assert second["learning_rate"] == pytest.approx(1e-4)  # 10% of warm_start_lr, where the cosine ended
  assert second["steps"] >= 1 and 3.0 <= second["seconds"] < 60
  for key in ("initial_eval_accuracy", "final_eval_accuracy", "initial_eval_greedy_accuracy",
              "final_eval_greedy_accuracy"):
    assert 0.0 <= second[key] <= 1.0, key
  # evaluated as a run's last version is (16 problems x 2 samples, not every evaluation's 12 x 4)
  assert second["eval_problems"] == 16 and second["eval_metric"].startswith("pass@1 (2 samples")
  assert 0.0 <= second["final_eval_greedy_accuracy_se"] <= 0.5 and second["final_eval_accuracy_se"] is not None
  assert (tmp_path / "b" / "warm_start" / "model.safetensors").exists()


def test_run_config_is_recorded_and_changes_are_named(tmp_path, capsys):
  from asyncrl_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.train import runlog  # pylint: disable=import-outside-toplevel
  c, path = config_lib.base_config(), tmp_path / "config.json"
  runlog.record_config(c, str(path))
  assert json.loads(path.read_text())["rl"]["loss"] == "decoupled_ppo"
  assert "differs" not in capsys.readouterr().out
  c.rl.loss, c.learner.batch_size = "dis", 64
  runlog.record_config(c, str(path))
  said = capsys.readouterr().out
  assert "learner.batch_size=32 -> 64" in said and "rl.loss='decoupled_ppo' -> 'dis'" in said
  assert json.loads(path.read_text())["rl"]["loss"] == "dis"


@pytest.mark.slow(56)
def test_a_long_run_holds_its_memory_steady(tmp_path):
  """300 versions of a tiny main job (decode server in process, checkpoints every 25 versions, so
  every kind of work has happened by version 50): host RSS at version 300 within 5% of version 50
  (medians of the 20 versions up to each: RSS saws with allocations and frees), the live JAX arrays
  no larger at the end than after warm-up (bytes: peaks; count: medians, as it moves with what is in
  flight), and no compilation
  after the first versions (both roles warmed up: every prefill and micro-batch shape at start)."""
  import statistics  # pylint: disable=import-outside-toplevel
  out = subprocess.run(
      [sys.executable, "-m", "asyncrl_jax.train", f"--config={ROOT}/configs/default.py",
       f"--workdir={tmp_path}", "--config.steps=300", "--config.data.num_train=300",
       "--config.data.num_test=20", "--config.data.final_eval_problems=0", "--config.learner.batch_size=4",
       "--config.rl.group_size=2",
       "--config.rollout.num_slots=6", "--config.data.max_completion_len=8",
       "--config.learner.token_budget=256", "--config.learner.eval_every=0",
       "--config.learner.warm_start_steps=0", "--config.checkpoint.every_steps=25"],
      capture_output=True, text=True, cwd=ROOT, timeout=600, env=_env())
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  m = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["version"] for r in m] == list(range(1, 301))
  rss = lambda v: statistics.median(r["host_rss_mb"] for r in m[v - 20:v])
  assert abs(rss(300) / rss(50) - 1) <= 0.05, (rss(50), rss(300))
  settled, end = m[9:150], m[150:]
  assert max(r["live_array_mb"] for r in end) <= 1.01 * max(r["live_array_mb"] for r in settled)
  # the count moves with what is in flight when a version is logged (peaks vary from run to run by
  # 30, medians by 1-2); a leak of one array every 15 versions would move the median by 10
  median = lambda rs, k: statistics.median(r[k] for r in rs)
  assert median(end, "live_arrays") <= median(settled, "live_arrays") + 10
  assert len({r["xla_compiles"] for r in m[9:]}) == 1, sorted({r["xla_compiles"] for r in m})


@pytest.mark.slow(60)
def test_the_coding_agent_trains_end_to_end_with_its_programs_run_in_the_sandbox(tmp_path):
  """configs/code_agent.py, tiny: episodes of the code environment (programs run on the public tests,
  failures back as observations, a submission scored on every test in the sandbox) under DIS."""
  cmd = [sys.executable, "-m", "asyncrl_jax.train", f"--config={ROOT}/configs/code_agent.py",
         f"--workdir={tmp_path}", *TINY, "--config.steps=2", "--config.learner.warm_start_steps=20",
         "--config.data.max_completion_len=96", "--config.model.max_seq_len=224"]
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=400, env=_env())
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  with open(tmp_path / "metrics.jsonl") as f:
    metrics = [json.loads(l) for l in f if l.strip()]
  assert [m["version"] for m in metrics] == [1, 2]
  assert sum(m["decode_env_steps"] for m in metrics) > 0 and sum(m["decode_env_errors"] for m in metrics) == 0
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["failed_rollouts"] == 0

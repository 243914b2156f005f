"""A learner over 2 processes (jax.distributed on 127.0.0.1, gloo collectives): the pod's learner
slice on one machine."""

import dataclasses
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.fixtures.helpers import random_sequences, sharp_params
from asyncrl_jax import config as config_lib, models
from asyncrl_jax.infra import distributed, sharding
from asyncrl_jax.learner.learner import Learner
from asyncrl_jax.models import value as value_lib
from asyncrl_jax.rl import batching
from asyncrl_jax.tokenization.builtin import ArithmeticTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = models.ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=128)


def config():
  c = config_lib.base_config()
  c.rl.loss = "decoupled_ppo"
  c.learner.ppo_minibatches = 2  # a prox pass and two optimizer updates
  c.learner.token_budget = 128
  c.learner.learning_rate = 3e-2
  return c


def params():
  return jax.device_get(sharp_params(CFG, 4, scale=2.0))  # host arrays: the same in every process


def sequences(n=14, seed=5):
  return random_sequences(seed, n, CFG.vocab_size, behav_prob=(0.05, 0.6))


TOK = ArithmeticTokenizer()
VALUE_CFG = dataclasses.replace(CFG, vocab_size=TOK.vocab_size)  # (the evaluation decodes its tokens)
PROBLEMS = [{"question": f"{i % 10}+{(i * 7) % 10}=", "answer": str(i % 10 + (i * 7) % 10)} for i in range(6)]


def value_config():
  """Single-rollout advantages from the critic; version 0 trains the value model only. Held-out
  evaluation: greedy and 2 samples per problem, 12 new tokens."""
  c = config_lib.base_config()
  c.rl.update(loss="dis", advantage="value", group_size=1, value_pretrain_versions=1, value_updates=2,
              value_learning_rate=3e-2)
  c.learner.update(token_budget=128, learning_rate=3e-2)
  c.data.update(max_prompt_len=8, max_completion_len=12, eval_samples=2)
  return c


def value_learner(mesh) -> Learner:
  """A value-mode learner whose value head is not zero (so the values, and the test, are not 0)."""
  c = value_config()
  policy = jax.device_get(sharp_params(VALUE_CFG, 4, scale=2.0))
  learner = Learner(VALUE_CFG, policy, mesh, c, versions=c.steps)
  value = jax.device_get(value_lib.init_value_params(policy))  # the trunk a copy of the policy's
  rng = np.random.default_rng(4)
  value["head"] = {"w": rng.normal(0, 0.3, CFG.hidden_size).astype(np.float32), "b": np.float32(0.2)}
  learner.critic.params = jax.device_put(value, learner.critic.updater.param_shardings)
  return learner


def value_evaluation(mesh, prompt_ids=None):
  """The main job's held-out evaluation on ``mesh`` (the learner's): ``PROBLEMS`` scored by the
  parity of the completion's length, or, in processes other than 0, ``prompt_ids`` and no answers."""
  from asyncrl_jax.rl.evaluation import RunEvaluation  # pylint: disable=import-outside-toplevel
  meshes = sharding.RoleMeshes(learner=mesh, rollout=None, remote=1, colocated=False)
  if prompt_ids is not None:
    return RunEvaluation(value_config(), VALUE_CFG, meshes, TOK, prompt_ids=prompt_ids)
  return RunEvaluation(value_config(), VALUE_CFG, meshes, TOK, problems=PROBLEMS,
                           reward=lambda text, answer: float(len(text) % 2 == 0))


def rewarded(n=12, seed=5):
  """Random trajectories with a 0/1 reward on each last token (the controller's value mode)."""
  rng = np.random.default_rng(seed + 100)
  out = []
  for s in random_sequences(seed, n, VALUE_CFG.vocab_size, behav_prob=(0.05, 0.6)):
    prompt = int(np.sum(s.mask == 0))
    out.append(batching.make_sequence(s.tokens[:prompt], s.tokens[prompt:], logprobs=s.behav_logp[prompt:],
                                      versions=s.versions[prompt:], token_reward=float(rng.integers(0, 2))))
  return out


VALUE_METRICS = ("value_loss", "value_loss_last_update", "value_explained_variance", "value_mean",
                 "return_mean", "loss", "policy_trained")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two_processes(out: str, *args: str) -> None:
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [subprocess.Popen([sys.executable, "-m", "tests.fixtures.multiprocess_learner", str(i), "2", str(port),
                             out, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=240)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  assert all(p.returncode == 0 for p in procs), "\n".join(l[-3000:] for l in logs)


def _one_process_learner():
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  c = config()
  return Learner(CFG, params(), mesh, c, versions=c.steps)


@pytest.mark.slow(50)
def test_two_process_learner_equals_one_process_and_checkpoints_move_between_process_counts(tmp_path):
  """One pair of processes (fsdp across them), two checks.

  * Update: their first version equals the one-process update on 2 local devices with the same
    mesh shape, each process holding half of every micro-batch and no whole weight matrix.
  * Checkpoints, 1 -> 2: a 1-process checkpoint restores onto the 2 processes bit for bit, and their
    next update equals the uninterrupted 1-process run's. 2 -> 1: what the 2 processes saved restores
    in 1 process bit for bit.
  """
  from asyncrl_jax.train.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  directory, out = str(tmp_path / "checkpoints"), str(tmp_path / "update.npz")
  learner = _one_process_learner()
  metrics = learner.train(sequences(), version=0)
  ckpt = Checkpointer(directory, async_save=False)
  ckpt.save(1, state=learner.checkpoint_state(), meta={"version": 1})
  ckpt.close()
  saved = jax.tree.leaves(jax.device_get(learner.params))
  learner.train(sequences(seed=6), version=1)  # the uninterrupted run's next version
  uninterrupted = jax.tree.leaves(jax.device_get(learner.params))
  _two_processes(out, directory)

  got = np.load(out)
  # fsdp over 2 processes: no parameter is whole in one process, and every weight matrix is split
  assert not got["whole_here"].any()
  assert got["split"][got["matrices"]].all()
  assert got["matrices"].sum() >= 8
  # each process put exactly half of every micro-batch's rows on device
  np.testing.assert_array_equal(got["held_rows"], [got["global_rows"] // 2] * 2)
  start = jax.tree.leaves(params())
  moved = max(float(np.max(np.abs(w - s))) for w, s in zip(saved, start))
  assert moved > 1e-2  # the update is large enough to compare
  for i, w in enumerate(saved):
    np.testing.assert_allclose(got[f"arr_{i}"], w, rtol=1e-4, atol=1e-5)
  assert float(got["loss"]) == pytest.approx(metrics["loss"], rel=1e-4)

  got = np.load(out.replace(".npz", "-resume.npz"))
  for i, (s, u) in enumerate(zip(saved, uninterrupted)):
    np.testing.assert_array_equal(got[f"restored_{i}"], s)
    np.testing.assert_allclose(got[f"trained_{i}"], u, rtol=1e-4, atol=1e-5)
  fresh = _one_process_learner()
  ckpt = Checkpointer(directory, async_save=False)
  assert ckpt.latest_step() == 2
  state, meta = ckpt.restore(2, state_like=fresh.checkpoint_state())
  restored = state["params"]
  ckpt.close()
  assert meta == {"version": 2}
  for i, r in enumerate(jax.tree.leaves(jax.device_get(restored))):
    np.testing.assert_array_equal(r, got[f"trained_{i}"])


@pytest.mark.slow(50)
def test_two_process_value_mode_and_evaluation_equal_one_process_and_the_checkpoint_holds_both(tmp_path):
  """Single-rollout advantages (the critic sharded like the policy) over 2 processes.

  * Two versions (value pre-training, then both models) give the one-process run's metrics, value
    figures included (statistics of token arrays that span both processes), and parameters.
  * Then a held-out evaluation as the main job runs it (process 0 holds the problems and answers,
    process 1 gets the prompt ids and follows the evaluate op): the same completions, scores and
    held-out value figures as one process.
  * The checkpoint the 2 processes wrote restores in 1 process with both models bit for bit.
  """
  from asyncrl_jax.train.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  directory, out = str(tmp_path / "checkpoints"), str(tmp_path / "value.npz")
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  learner = value_learner(mesh)
  start = jax.tree.leaves(jax.device_get(learner.critic.params))
  metrics = [learner.train(rewarded(seed=v), version=v) for v in range(2)]
  evaluation = value_evaluation(mesh)
  (accuracy, greedy), figures = evaluation.run(learner)
  _two_processes(out, "--value", directory)

  got = np.load(out)
  assert [m["policy_trained"] for m in metrics] == [0.0, 1.0]
  assert "loss" not in metrics[0] and "loss" in metrics[1]  # (version 0 trained the value model only)
  for v, m in enumerate(metrics):
    assert sorted(f for f in got.files if f.startswith(f"v{v}_")) == sorted(
        f"v{v}_{k}" for k in VALUE_METRICS if k in m)
    for k in [k for k in VALUE_METRICS if k in m]:
      assert float(got[f"v{v}_{k}"]) == pytest.approx(m[k], rel=1e-3, abs=1e-5), (v, k)
  assert metrics[1]["value_explained_variance"] != 0 and metrics[1]["value_mean"] != 0
  value = jax.tree.leaves(jax.device_get(learner.critic.params))
  assert max(float(np.max(np.abs(a - b))) for a, b in zip(value, start)) > 1e-2  # it trained
  for i, p in enumerate(jax.tree.leaves(jax.device_get(learner.params))):
    np.testing.assert_allclose(got[f"policy_{i}"], p, rtol=1e-4, atol=1e-5)
  for i, w in enumerate(value):
    np.testing.assert_allclose(got[f"value_{i}"], w, rtol=1e-4, atol=1e-5)

  # the evaluation: 6 problems, greedy then 2 samples each (the primary figure's are last_samples)
  samples = evaluation.evaluator.last_samples
  assert len(samples) == 12 and 0 < accuracy < 1
  completions = [c for _, c, _ in samples]
  assert len({tuple(c) for c in completions}) > 2  # the completions differ: a comparison that can fail
  np.testing.assert_array_equal(got["eval_scores"], [r for _, _, r in samples])
  np.testing.assert_array_equal(got["eval_completions"], _padded(completions))
  assert float(got["eval_accuracy"]) == accuracy and float(got["eval_greedy"]) == greedy
  assert float(got["follower_eval_accuracy"]) == accuracy  # process 1 got process 0's scores
  assert set(figures) == {"eval_value_explained_variance", "eval_value_mean", "eval_return_mean",
                          "eval_accuracy_se", "eval_greedy_accuracy_se"}
  per_problem = np.asarray([r for _, _, r in samples], np.float64).reshape(6, 2).mean(axis=1)
  assert figures["eval_accuracy_se"] == pytest.approx(np.std(per_problem, ddof=1) / np.sqrt(6))
  for k, v in figures.items():
    assert float(got[k]) == pytest.approx(v, rel=1e-4, abs=1e-6), k

  ckpt = Checkpointer(directory, async_save=False)
  state, _ = ckpt.restore(2, state_like=learner.checkpoint_state())
  ckpt.close()
  for i, r in enumerate(jax.tree.leaves(jax.device_get(state["value_params"]))):
    np.testing.assert_array_equal(r, got[f"value_{i}"])
  for i, r in enumerate(jax.tree.leaves(jax.device_get(state["params"]))):
    np.testing.assert_array_equal(r, got[f"policy_{i}"])


def _padded(rows) -> np.ndarray:
  out = np.full((len(rows), max(len(r) for r in rows)), -1, np.int32)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return out


@pytest.mark.parametrize("env,message", [
    ({"ASYNCRL_COORDINATOR": "127.0.0.1:1234"}, "missing ASYNCRL_NUM_PROCESSES, ASYNCRL_PROCESS_ID"),
    ({"ASYNCRL_COORDINATOR": "127.0.0.1:1234", "ASYNCRL_NUM_PROCESSES": "2", "ASYNCRL_PROCESS_ID": "2"},
     r"process id 2 must lie in \[0, 2\)"),
    ({"ASYNCRL_COORDINATOR": "localhost", "ASYNCRL_NUM_PROCESSES": "2", "ASYNCRL_PROCESS_ID": "0"},
     "must be HOST:PORT"),
    ({"ASYNCRL_COORDINATOR": "h:1", "ASYNCRL_NUM_PROCESSES": "two", "ASYNCRL_PROCESS_ID": "0"},
     "must be integers"),
])
def test_distributed_settings_refuse_partial_or_bad_values(monkeypatch, env, message):
  for k in distributed.ENV:
    monkeypatch.delenv(k, raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  with pytest.raises(ValueError, match=message):
    distributed.settings()


def test_distributed_settings_from_the_environment_and_single_process(monkeypatch):
  for k in distributed.ENV:
    monkeypatch.delenv(k, raising=False)
  assert distributed.settings() is None
  assert distributed.initialize(on_tpu=False) is False  # nothing named: one process
  monkeypatch.setenv("ASYNCRL_COORDINATOR", "10.0.0.2:8476")
  monkeypatch.setenv("ASYNCRL_NUM_PROCESSES", "4")
  monkeypatch.setenv("ASYNCRL_PROCESS_ID", "3")
  assert distributed.settings() == {"coordinator_address": "10.0.0.2:8476", "num_processes": 4,
                                    "process_id": 3}


@pytest.mark.slow(13)
def test_weights_move_shard_to_shard_between_unlike_layouts(tmp_path):
  """Learner fsdp=2 over 2 processes -> a decode server with tensor=2 on its 2 local devices: the
  server holds the learner's exact parameters in its own layout, and every buffer that crossed
  between processes is one shard, each offered once."""
  from asyncrl_jax.weights import shards  # pylint: disable=import-outside-toplevel
  out, port = str(tmp_path), _free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  cmd = [sys.executable, "-m", "tests.fixtures.multiprocess_transfer"]
  procs = [subprocess.Popen(cmd + ["learner", str(i), str(port), out], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  procs.append(subprocess.Popen(cmd + ["server", out], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True))
  logs = []
  try:
    logs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert all(p.returncode == 0 for p in procs), "\n".join(l[-3000:] for l in logs)
  learner, server = np.load(f"{out}/learner.npz"), np.load(f"{out}/server.npz")
  assert len(learner.files) == len(server.files) >= 10
  for k in learner.files:
    np.testing.assert_array_equal(server[k], learner[k])
  pulled = json.loads((tmp_path / "pulled.json").read_text())
  offered = [json.loads((tmp_path / f"offered-{i}.json").read_text()) for i in range(2)]
  assert all(pulled["layout_ok"])
  # what crossed is what was offered, shard by shard, and both learner processes offered a share
  assert sorted(map(tuple, pulled["shapes"])) == sorted(tuple(s) for o in offered for s in o["shapes"])
  assert pulled["bytes"] == sum(o["bytes"] for o in offered) == sum(learner[k].nbytes for k in learner.files)
  assert min(o["bytes"] for o in offered) > 0.3 * pulled["bytes"]
  # every buffer is shard-shaped: a split leaf crossed as halves, never whole
  ref = jax.tree.leaves(params())
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  planned = shards.plan(ref, jax.tree.leaves(models.param_shardings(CFG, mesh)))
  assert sorted(b.shape for b, _ in planned) == sorted(map(tuple, pulled["shapes"]))
  split = [b for b, _ in planned if b.shape != ref[b.leaf].shape]
  assert len(split) >= 8
  # the server's layout is its own: tensor-split leaves are halves on each of its devices
  assert any(len({tuple(s) for s in shapes}) == 1 and tuple(shapes[0]) != ref[i].shape
             for i, shapes in enumerate(pulled["local_shards"]))

"""The held-out evaluation's figures: standard errors by hand, and a fresh sampling key per version."""

import threading
import time

import jax
import numpy as np
import pytest

from tests.fixtures.helpers import sharp_params
from asyncrl_jax import models
from asyncrl_jax.infra import sharding
from asyncrl_jax.models.sampling import SamplingSettings
from asyncrl_jax.rl import evaluation
from asyncrl_jax.tokenization import load_tokenizer


def test_figures_and_standard_errors_by_hand():
  # greedy 0/1 over 4 problems: mean 0.5, sd (ddof 1) sqrt(1/3), SE sqrt(1/3)/2
  # sampled, 2 per problem: per-problem means 1, 0.5, 0, 0.5 -> mean 0.5, sd sqrt(1/6), SE sqrt(1/6)/2
  out = evaluation.figures(np.array([1, 0, 1, 0]), np.array([1, 1, 1, 0, 0, 0, 0, 1]), 2)
  assert out["greedy"] == 0.5 and out["greedy_se"] == pytest.approx(np.sqrt(1 / 3) / 2)
  assert out["sampled"] == 0.5 and out["sampled_se"] == pytest.approx(np.sqrt(1 / 6) / 2)
  # the SE is over problems: the same rewards read as 8 single samples would give another figure
  assert evaluation.figures(np.zeros(2), np.array([1, 1, 1, 0, 0, 0, 0, 1]), 1)["sampled_se"] == (
      pytest.approx(np.std([1, 1, 1, 0, 0, 0, 0, 1], ddof=1) / np.sqrt(8)))
  assert evaluation.figures(np.ones(1), None, 0) == {"greedy": 1.0, "greedy_se": 0.0, "sampled": None,
                                                      "sampled_se": None}


def test_each_version_draws_its_own_samples_and_one_version_the_same_ones():
  cfg = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, max_seq_len=64)
  tok = load_tokenizer("")
  if tok.vocab_size > cfg.vocab_size:
    cfg = cfg.replace(vocab_size=tok.vocab_size)
  mesh = sharding.make_mesh(jax.devices()[:1], dict(data=-1, fsdp=1, tensor=1))
  problems = [{"question": f"{a}+{a}=", "answer": str(2 * a)} for a in range(1, 7)]
  evaluator = evaluation.Evaluator(cfg, mesh, tok, problems, max_prompt_len=16, max_new_tokens=8,
                                   samples=4, sampling=SamplingSettings(temperature=1.0), seed=3)
  params = sharp_params(cfg, 0)

  def completions(version):
    evaluator.sample(params, lambda text, answer: 0.0, version=version)
    return [tuple(int(t) for t in c) for _, c, _ in evaluator.last_samples]

  assert completions(5) == completions(5)  # one version, one draw (paired across runs of a seed)
  assert completions(5) != completions(6)  # the next evaluation draws afresh
  assert completions(None) != completions(5)
  out = evaluator.evaluate(params, lambda text, answer: float(text.strip() == answer), version=2)
  assert set(out) == {"greedy", "sampled", "greedy_se", "sampled_se"} and out["sampled_se"] >= 0
  # scored on threads, each score stays with its completion: a reward that finishes out of order
  # (the earlier completions wait longest) gives each one what it gives it alone
  key = lambda text, answer: (len(text) * 7 + int(answer)) % 11 / 10  # noqa: E731
  threads = set()

  def slow(text, answer):
    threads.add(threading.get_ident())
    time.sleep(0.02 * (3 - int(answer) % 4))
    return key(text, answer)
  slow.concurrent = True  # (as rl.rewards.CodeReward declares; other rewards are scored in turn)

  scores = evaluator.sample(params, slow, version=5)
  texts = [tok.decode(list(c)) for _, c, _ in evaluator.last_samples]
  answers = [p["answer"] for p in problems for _ in range(4)]
  assert scores.tolist() == pytest.approx([key(t, a) for t, a in zip(texts, answers)])
  assert len(set(scores.tolist())) > 3 and len(threads) > 1
  threads.clear()
  del slow.concurrent  # a reward that does not say it is safe on threads: one thread, same scores
  assert evaluator.sample(params, slow, version=5).tolist() == scores.tolist() and len(threads) == 1


def _run_evaluation(**data):
  """A main-job evaluation of 6 problems on one device (final fields in ``data``), run to version 4."""
  from asyncrl_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  c = config_lib.base_config()
  c.steps = 4
  c.data.update(max_prompt_len=8, max_completion_len=8, eval_problems=3, eval_samples=2, **data)
  tok = load_tokenizer("")
  cfg = models.ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                           num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32)
  mesh = sharding.make_mesh(jax.devices()[:1], dict(data=-1, fsdp=1, tensor=1))
  meshes = sharding.RoleMeshes(learner=mesh, rollout=None, remote=1, colocated=False)
  problems = [{"question": f"{a}+{a}=", "answer": str(2 * a)} for a in range(1, 7)]
  run = evaluation.RunEvaluation(c, cfg, meshes, tok, problems=problems,
                                 reward=lambda text, answer: float(len(text) % 2 == 0))
  return run, sharp_params(cfg, 0), c


class _Learner:  # what RunEvaluation.run reads of a learner
  critic = None

  def __init__(self, params, version):
    self.params, self.version = params, version


def test_the_last_version_is_evaluated_on_the_final_problems_and_samples():
  run, params, config = _run_evaluation(final_eval_problems=6, final_eval_samples=4)
  assert len(run.prompt_ids) == 6  # (what process 0 shares: enough for the final evaluation)
  (accuracy, _), extra = run.run(_Learner(params, 1), params)
  assert len(run.evaluator.last_samples) == 3 * 2 and "2 samples" in run.kind
  assert accuracy == pytest.approx(np.mean([r for _, _, r in run.evaluator.last_samples]))
  (accuracy, greedy), extra = run.run(_Learner(params, config.steps), params)
  samples = run.final_evaluator.last_samples
  assert len(samples) == 6 * 4 and accuracy == pytest.approx(np.mean([r for _, _, r in samples]))
  per_problem = np.asarray([r for _, _, r in samples]).reshape(6, 4).mean(axis=1)
  assert 0 < per_problem.std() and extra["eval_accuracy_se"] == pytest.approx(
      np.std(per_problem, ddof=1) / np.sqrt(6))
  final = run.final_figures()
  assert final["final_eval_problems"] == 6 and "4 samples" in final["final_eval_metric"]
  assert final["final_eval_accuracy_se"] == extra["eval_accuracy_se"]
  # a process other than 0 builds the same two evaluations from the shared prompts
  follower = evaluation.RunEvaluation(config, run.evaluator.model_config, sharding.RoleMeshes(
      learner=run.evaluator.mesh, rollout=None, remote=1, colocated=False), run.evaluator.tokenizer,
      prompt_ids=run.prompt_ids)
  assert [len(follower.evaluator.prompt_ids), follower.evaluator.samples] == [3, 2]
  assert [len(follower.final_evaluator.prompt_ids), follower.final_evaluator.samples] == [6, 4]


def test_without_final_fields_the_last_version_is_evaluated_as_every_other():
  run, params, config = _run_evaluation()
  assert run.final_evaluator is run.evaluator and len(run.prompt_ids) == 3
  run.run(_Learner(params, config.steps), params)
  assert len(run.evaluator.last_samples) == 3 * 2 and run.final_figures()["final_eval_problems"] == 3


def test_the_starting_weights_are_also_evaluated_as_the_last_version_will_be():
  """At version 0 (a fresh run) the weights get the final evaluation too, with a key of their own,
  so before and after RL compare on the same problems; every later version gets only its own."""
  run, params, config = _run_evaluation(final_eval_problems=6, final_eval_samples=4)
  reward = run.reward
  (accuracy, greedy), extra = run.run(_Learner(params, 0), params)
  assert run.last_evaluator is run.evaluator  # (the version's own evaluation stays the last one)
  assert len(run.evaluator.last_samples) == 3 * 2
  samples = run.final_evaluator.last_samples
  assert len(samples) == 6 * 4
  assert extra["initial_final_eval_accuracy"] == pytest.approx(np.mean([r for _, _, r in samples]))
  per_problem = np.asarray([r for _, _, r in samples]).reshape(6, 4).mean(axis=1)
  assert extra["initial_final_eval_accuracy_se"] == pytest.approx(np.std(per_problem, ddof=1) / np.sqrt(6))
  # the same figure as the final evaluator gives these weights at version 0 on its own
  again = run.final_evaluator.evaluate(params, reward, version=0)
  assert again["sampled"] == extra["initial_final_eval_accuracy"]
  assert again["greedy"] == extra["initial_final_eval_greedy_accuracy"]
  _, later = run.run(_Learner(params, 1), params)
  assert not any(k.startswith("initial_final") for k in later)
  # off, or with no larger final evaluation: nothing more at version 0
  off, params, _ = _run_evaluation(final_eval_problems=6, final_eval_samples=4, initial_eval_final=False)
  _, extra = off.run(_Learner(params, 0), params)
  assert not any(k.startswith("initial_final") for k in extra)
  same, params, _ = _run_evaluation()
  _, extra = same.run(_Learner(params, 0), params)
  assert not any(k.startswith("initial_final") for k in extra)

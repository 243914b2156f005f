"""Held-out evaluation: greedy accuracy and pass@1 of sampled completions, decoded in one XLA program.

Over several learner processes (the learner mesh spanning them) every process runs the same
evaluation: each puts its own rows of the prompts on device, all decode together, every process
gathers the completions, process 0 (which alone holds the answers) scores them, and the scores are
broadcast, so that every process ends with the same ``last_samples``.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from asyncrl_jax import envs, models

from asyncrl_jax.infra import sharding
from asyncrl_jax.models.generate import generate
from asyncrl_jax.models.sampling import SamplingSettings
from asyncrl_jax.rl import batching
from asyncrl_jax.rl.episode_eval import EpisodeEvaluator
from asyncrl_jax.rl.scores import eval_key, figures, standard_error  # noqa: F401  (part of this module's interface)
from asyncrl_jax.weights import local_transfer

REWARD_THREADS = 4  # held-out completions scored at once


class Evaluator:
  """Held-out accuracy, decoded on the mesh it is given (the main job's: the rollout mesh, or the
  learner's when the decode servers are other processes): greedy, and pass@1 over sampled completions.

  The sampled accuracy is the mean reward of ``samples`` completions per problem drawn as the decode
  servers draw them (``sampling``: temperature, top-k, top-p), i.e. the quantity RL maximises. The PRNG
  key is the run's seed folded with the policy version evaluated (``version``): a fresh draw at
  every evaluation (so that one draw's luck does not carry through a run's curve), the same draw
  for two runs of one seed at one version (paired comparisons). Each figure comes with its standard
  error over problems (``*_se``: the spread of the per-problem means, sampling noise included).

  ``problems`` (dicts with ``question`` and ``answer``) is None in learner processes other than 0,
  which are given the prompts' token ids instead (``prompt_ids``, process 0's ``prompt_ids``) and
  score nothing.
  """

  def __init__(self, model_config, mesh, tokenizer, problems, *, max_prompt_len: int, max_new_tokens: int,
               samples: int = 0, sampling=None, seed: int = 0, prompt_ids: Optional[list] = None):
    self.model_config, self.mesh, self.tokenizer = model_config, mesh, tokenizer
    self.problems = problems
    self.max_new_tokens = max_new_tokens
    self.samples = samples if sampling is not None and sampling.temperature > 0 else 0
    self.sampling, self.seed = sampling, seed
    ways = sharding.batch_ways(mesh)
    if (problems is None) == (prompt_ids is None):
      raise ValueError("an Evaluator takes either problems or prompt_ids")
    ids = ([tokenizer.encode_prompt(p["question"]) for p in problems] if problems is not None else
           [np.asarray(x, np.int32) for x in prompt_ids])
    for i, x in enumerate(ids):
      if len(x) > max_prompt_len:
        raise ValueError(f"eval problem {i} has {len(x)} prompt tokens > data.max_prompt_len")

    def put(rows_ids):
      rows = -(-len(rows_ids) // ways) * ways
      prompts = np.full((rows, max_prompt_len), tokenizer.pad_id, np.int32)
      lengths = np.ones(rows, np.int32)
      for r, x in enumerate(rows_ids):
        prompts[r, :len(x)] = x
        lengths[r] = len(x)
      return _place(prompts, sharding.batch_sharding(mesh, 2)), _place(lengths, sharding.batch_sharding(mesh, 1))

    self.prompt_ids = ids
    self.last_samples: list = []  # (prompt ids, completion ids, reward) of the last evaluation
    self._greedy = put(ids)
    self._sampled = put([x for x in ids for _ in range(self.samples)]) if self.samples else None

  @classmethod
  def from_config(cls, config, model_config, mesh, tokenizer, problems, *,
                  prompt_ids: Optional[list] = None, samples: Optional[int] = None) -> "Evaluator":
    """The main job's evaluation: ``data`` section lengths and samples (``samples`` given: that many),
    the decode servers' sampling."""
    return cls(model_config, mesh, tokenizer, problems, max_prompt_len=config.data.max_prompt_len,
               max_new_tokens=config.data.max_completion_len,
               samples=config.data.eval_samples if samples is None else samples,
               sampling=SamplingSettings.from_config(config), seed=config.seed, prompt_ids=prompt_ids)

  def _scores(self, tokens, lengths, prompts, answers, reward) -> np.ndarray:
    """Each completion's reward (``answers`` None: process 0's, broadcast); the completions and their
    rewards are kept as ``last_samples``."""
    tokens, lengths = _host(tokens), _host(lengths)
    completions = [tokens[i, :lengths[i]] for i in range(len(prompts))]
    scores = np.zeros(len(prompts), np.float32)
    if answers is not None:
      score = lambda ca: reward(self.tokenizer.decode(ca[0]), ca[1])  # noqa: E731
      if getattr(reward, "concurrent", False):  # a code reward's sandbox runs are processes, which
        # threads wait on together (in order: pool.map keeps it)
        with cf.ThreadPoolExecutor(REWARD_THREADS, thread_name_prefix="eval-reward") as pool:
          scores[:] = list(pool.map(score, zip(completions, answers)))
      else:
        scores[:] = [score(ca) for ca in zip(completions, answers)]
    if jax.process_count() > 1:
      scores = np.asarray(multihost_utils.broadcast_one_to_all(scores), np.float32)
    self.last_samples = list(zip(prompts, completions, scores.tolist()))
    return scores

  def _answers(self) -> Optional[list]:
    return [p["answer"] for p in self.problems] if self.problems is not None else None

  def evaluate(self, params, reward, version: Optional[int] = None) -> dict:
    """``{"greedy": acc, "sampled": pass@1 or None, "greedy_se", "sampled_se"}`` on the held-out
    problems (``version``: the policy's, which picks the sampling key). The completions of the
    primary figure (sampled, else greedy) stay in ``last_samples`` as (prompt ids, completion ids,
    reward)."""
    answers = self._answers()
    out = generate(self.model_config, params, *self._greedy, max_new_tokens=self.max_new_tokens,
                   eos_id=self.tokenizer.eos_id, mesh=self.mesh)
    return figures(self._scores(*out, self.prompt_ids, answers, reward),
                   self.sample(params, reward, version=version) if self.samples else None, self.samples)

  def sample(self, params, reward, *, seed=None, version: Optional[int] = None) -> np.ndarray:
    """The rewards of ``samples`` completions per problem (problem-major) drawn as the decode servers
    draw them, with PRNG seed ``seed`` (default: the evaluator's own) folded with ``version`` when
    given; the completions stay in ``last_samples``."""
    if not self.samples:
      raise ValueError("this evaluator draws no samples (samples=0 or greedy sampling settings)")
    out = generate(self.model_config, params, *self._sampled,
                   eval_key(self.seed if seed is None else seed, version),
                   max_new_tokens=self.max_new_tokens, eos_id=self.tokenizer.eos_id, mesh=self.mesh,
                   settings=self.sampling)
    repeat = lambda xs: [x for x in xs for _ in range(self.samples)] if xs is not None else None
    return self._scores(*out, repeat(self.prompt_ids), repeat(self._answers()), reward)


def _place(array: np.ndarray, where) -> jax.Array:
  """``array`` (the same in every process) on sharding ``where``: each process puts its own rows."""
  return jax.make_array_from_callback(array.shape, where, lambda index: array[index])


def _host(x: jax.Array) -> np.ndarray:
  """The whole of ``x`` in this process (gathered from the others' devices when they hold part)."""
  if x.is_fully_addressable:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class RunEvaluation:
  """The main job's held-out evaluation, on the rollout mesh (or the learner's when decode servers are
  remote), of the learner's parameters (or of the in-process decode server's copy of them, when the
  caller passes it), with the critic's held-out figures in value mode.

  Every evaluation reads the first ``data.eval_problems`` problems with ``data.eval_samples`` samples
  each; that of the run's last version (``config.steps``) reads the first ``data.final_eval_problems``
  with ``data.final_eval_samples`` (``final_evaluator``) when those are set. ``problems`` (or
  ``prompt_ids``) holds enough for both.

  In learner processes other than 0 it is built from process 0's prompt ids (``prompt_ids``: its
  ``prompt_ids``) and scores nothing (``Evaluator``); every process runs ``run`` together."""

  def __init__(self, config, model_config, meshes, tokenizer, *, problems=None,
               reward=None, prompt_ids=None):
    mesh = meshes.rollout or meshes.learner
    self.shardings = models.param_shardings(model_config, mesh)
    n, samples = config.data.eval_problems, config.data.eval_samples
    final_n, final_samples = final_size(config)
    first = lambda k: dict(problems=problems[:k] if problems is not None else None,
                           prompt_ids=prompt_ids[:k] if prompt_ids is not None else None)
    self.evaluator = evaluator_for(config, model_config, mesh, tokenizer, **first(n))
    self.final_evaluator = self.evaluator
    if (final_n, final_samples) != (n, samples):
      self.final_evaluator = evaluator_for(config, model_config, mesh, tokenizer, **first(final_n),
                                           samples=final_samples)
    self.final_version = config.steps
    # the starting weights (version 0) also get the last version's evaluation, when it differs
    self.initial_final = (bool(config.data.initial_eval_final) and self.final_evaluator is not self.evaluator
                          and self.final_version != 0)
    # what process 0 shares with the others: the prompts of the larger of the two
    self.prompt_ids = max(self.evaluator.prompt_ids, self.final_evaluator.prompt_ids, key=len)
    self.reward = reward
    self.kind = eval_kind(self.evaluator)
    self.final_kind = eval_kind(self.final_evaluator)
    self.last: dict = {}  # the last evaluation's figures (``figures``)
    self.last_evaluator = self.evaluator  # (the one that made them)

  def __call__(self, learner_params, rollout_params=None, version: Optional[int] = None) -> tuple[float, float]:
    """(primary accuracy, greedy accuracy) of the params (the decode server's copy when given) at
    policy ``version`` (which picks the sampling key, and the final evaluation at the last version);
    every figure is kept in ``last``."""
    params = self._served(learner_params, rollout_params)
    evaluator = self.final_evaluator if version == self.final_version else self.evaluator
    self.last = evaluator.evaluate(params, self.reward, version=version)
    self.last_evaluator = evaluator
    return primary(self.last), self.last["greedy"]

  def _served(self, learner_params, rollout_params):
    """The weights to evaluate: the decode server's copy when given, else the learner's on this
    evaluation's mesh."""
    if rollout_params is not None:
      return rollout_params
    return local_transfer(learner_params, self.shardings)[0]

  def final_figures(self) -> dict:
    """What the summary says of the last evaluation: its kind and number of problems, and the
    standard errors of its accuracies."""
    if not self.last:
      return {}
    evaluator = self.last_evaluator
    return {"final_eval_metric": eval_kind(evaluator), "final_eval_problems": len(evaluator.prompt_ids),
            "final_eval_accuracy_se": self.standard_errors()["eval_accuracy_se"],
            "final_eval_greedy_accuracy_se": self.standard_errors()["eval_greedy_accuracy_se"]}

  def standard_errors(self) -> dict:
    """The last evaluation's standard errors as metrics (``eval_accuracy_se``, ``eval_greedy_accuracy_se``)."""
    if not self.last:
      return {}
    se = self.last["sampled_se"] if self.last["sampled"] is not None else self.last["greedy_se"]
    return {"eval_accuracy_se": se, "eval_greedy_accuracy_se": self.last["greedy_se"]}

  def run(self, learner, rollout_params=None) -> tuple[tuple[float, float], dict]:
    """The accuracies, their standard errors and, with a critic, the value model's ``value_figures``;
    at version 0 with ``initial_final`` also the last version's evaluation of these weights
    (``initial_final_eval_accuracy``, ``..._greedy_accuracy`` and their ``_se``; every learner
    process runs it, as it runs ``run``)."""
    accuracy = self(learner.params, rollout_params, version=learner.version)
    extra = self.standard_errors()
    if learner.critic is not None:
      extra.update(self.value_figures(learner.critic))
    if learner.version == 0 and self.initial_final:
      kept = self.last, self.last_evaluator
      params = self._served(learner.params, rollout_params)
      self.last, self.last_evaluator = self.final_evaluator.evaluate(params, self.reward, version=0), \
          self.final_evaluator
      se = self.standard_errors()
      extra.update(initial_final_eval_accuracy=primary(self.last),
                   initial_final_eval_greedy_accuracy=self.last["greedy"],
                   initial_final_eval_accuracy_se=se["eval_accuracy_se"],
                   initial_final_eval_greedy_accuracy_se=se["eval_greedy_accuracy_se"])
      self.last, self.last_evaluator = kept
    return accuracy, extra

  def value_figures(self, critic) -> dict:
    """The value model's explained variance (and means) on the last evaluation's held-out
    completions, as ``eval_value_*`` metrics."""
    # an episode's samples carry their action mask: the value model is scored on policy tokens only
    sequences = [batching.make_sequence(p, c, token_reward=r, action_mask=rest[0] if rest else None)
                 for p, c, r, *rest in self.last_evaluator.last_samples if len(c)]
    if not sequences:
      return {}
    return {f"eval_{k}": v for k, v in critic.explained_variance(sequences).items()}


def evaluator_for(config, model_config, mesh, tokenizer, problems, *, prompt_ids=None,
                  samples: Optional[int] = None):
  """The held-out evaluation a run's config asks for: of multi-turn episodes, scored by their
  environments, when ``env.name`` is set (``EpisodeEvaluator``), else of single completions
  (``samples``: per problem, default ``data.eval_samples``)."""
  episode = envs.episode_template(config)
  if episode is not None:
    return EpisodeEvaluator.from_config(config, model_config, mesh, tokenizer, problems, episode=episode,
                                        samples=samples)
  return Evaluator.from_config(config, model_config, mesh, tokenizer, problems, prompt_ids=prompt_ids,
                               samples=samples)


def final_size(config) -> tuple[int, int]:
  """(problems, samples per problem) of the evaluation of a run's last version."""
  data = config.data
  return (data.final_eval_problems or data.eval_problems,
          data.final_eval_samples or data.eval_samples)


def eval_kind(evaluator: Evaluator) -> str:
  if evaluator.samples:
    return f"pass@1 ({evaluator.samples} samples, T={evaluator.sampling.temperature:g})"
  return "greedy"


def primary(result: dict) -> float:
  """The headline held-out accuracy: sampled pass@1 when sampling is evaluated, else greedy."""
  return result["sampled"] if result["sampled"] is not None else result["greedy"]

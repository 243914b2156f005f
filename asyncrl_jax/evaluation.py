"""Held-out evaluation: greedy accuracy and pass@1 of sampled completions, decoded in one XLA program."""

from __future__ import annotations

import jax
import numpy as np

from asyncrl_jax import sharding
from asyncrl_jax.models.generate import generate
from asyncrl_jax.models.sampling import SamplingSettings


class Evaluator:
  """Held-out accuracy, decoded on the rollout mesh: greedy, and pass@1 over sampled completions.

  The sampled accuracy is the mean reward of ``samples`` completions per problem drawn as the decode
  servers draw them (``sampling``: temperature, top-k, top-p), i.e. the quantity RL maximises. The PRNG
  key is the same at every evaluation, so successive evaluations differ by the weights only.
  """

  def __init__(self, model_config, mesh, tokenizer, problems, *, max_prompt_len: int, max_new_tokens: int,
               samples: int = 0, sampling=None, seed: int = 0):
    self.model_config, self.mesh, self.tokenizer = model_config, mesh, tokenizer
    self.problems = problems
    self.max_new_tokens = max_new_tokens
    self.samples = samples if sampling is not None and sampling.temperature > 0 else 0
    self.sampling, self.seed = sampling, seed
    ways = mesh.shape["data"] * mesh.shape["fsdp"]
    ids = []
    for i, p in enumerate(problems):
      ids.append(tokenizer.encode_prompt(p["question"]))
      if len(ids[-1]) > max_prompt_len:
        raise ValueError(f"eval problem {i} has {len(ids[-1])} prompt tokens > data.max_prompt_len")

    def put(rows_ids):
      rows = -(-len(rows_ids) // ways) * ways
      prompts = np.full((rows, max_prompt_len), tokenizer.pad_id, np.int32)
      lengths = np.ones(rows, np.int32)
      for r, x in enumerate(rows_ids):
        prompts[r, :len(x)] = x
        lengths[r] = len(x)
      return (jax.device_put(prompts, sharding.batch_sharding(mesh, 2)),
              jax.device_put(lengths, sharding.batch_sharding(mesh, 1)))

    self.prompt_ids = ids
    self.last_samples: list = []  # (prompt ids, completion ids, reward) of the last evaluation
    self._greedy = put(ids)
    self._sampled = put([x for x in ids for _ in range(self.samples)]) if self.samples else None

  @classmethod
  def from_config(cls, config, model_config, mesh, tokenizer, problems) -> "Evaluator":
    """The main job's evaluation: ``data`` section lengths and samples, the decode servers' sampling."""
    return cls(model_config, mesh, tokenizer, problems, max_prompt_len=config.data.max_prompt_len,
               max_new_tokens=config.data.max_completion_len, samples=config.data.eval_samples,
               sampling=SamplingSettings.from_config(config), seed=config.seed)

  def _scores(self, tokens, lengths, prompts, answers, reward) -> np.ndarray:
    """Each completion's reward; the completions and their rewards are kept as ``last_samples``."""
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    completions = [tokens[i, :lengths[i]] for i in range(len(answers))]
    scores = np.array([reward(self.tokenizer.decode(c), a) for c, a in zip(completions, answers)],
                      np.float32)
    self.last_samples = list(zip(prompts, completions, scores.tolist()))
    return scores

  def evaluate(self, params, reward) -> dict:
    """``{"greedy": acc, "sampled": pass@1 or None}`` on the held-out problems. The completions of
    the primary figure (sampled, else greedy) stay in ``last_samples`` as (prompt ids, completion
    ids, reward)."""
    answers = [p["answer"] for p in self.problems]
    out = generate(self.model_config, params, *self._greedy, max_new_tokens=self.max_new_tokens,
                   eos_id=self.tokenizer.eos_id, mesh=self.mesh)
    result = {"greedy": float(self._scores(*out, self.prompt_ids, answers, reward).mean()),
              "sampled": None}
    if self.samples:
      result["sampled"] = float(self.sample(params, reward).mean())
    return result

  def sample(self, params, reward, *, seed=None) -> np.ndarray:
    """The rewards of ``samples`` completions per problem (problem-major) drawn as the decode servers
    draw them, with PRNG seed ``seed`` (default: the evaluator's own, the same every time); the
    completions stay in ``last_samples``."""
    if not self.samples:
      raise ValueError("this evaluator draws no samples (samples=0 or greedy sampling settings)")
    out = generate(self.model_config, params, *self._sampled,
                   jax.random.key(self.seed if seed is None else seed),
                   max_new_tokens=self.max_new_tokens, eos_id=self.tokenizer.eos_id, mesh=self.mesh,
                   settings=self.sampling)
    repeat = lambda xs: [x for x in xs for _ in range(self.samples)]
    return self._scores(*out, repeat(self.prompt_ids), repeat([p["answer"] for p in self.problems]),
                        reward)


def eval_kind(evaluator: Evaluator) -> str:
  if evaluator.samples:
    return f"pass@1 ({evaluator.samples} samples, T={evaluator.sampling.temperature:g})"
  return "greedy"


def primary(result: dict) -> float:
  """The headline held-out accuracy: sampled pass@1 when sampling is evaluated, else greedy."""
  return result["sampled"] if result["sampled"] is not None else result["greedy"]

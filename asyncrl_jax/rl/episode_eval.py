"""Held-out evaluation of multi-turn episodes: each turn's actions decoded for every problem in one
XLA program (``models.generate``), the environments stepped on the host between turns.

A turn's decoding stops at the environment's stop sequence, which must be a single token of the
tokenizer (as the built-in tool task's ``]`` is), or at the end of sequence.
The next turn prefills each episode's whole context (prompt, actions and observations so far): the
evaluation measures the policy, not the decode servers' cache reuse. The score of an episode is its
environment's summed reward, as in training; a step that raises scores the episode 0.
"""

from __future__ import annotations

from concurrent import futures
from typing import Optional

import jax
import numpy as np

from asyncrl_jax.envs import base as envs_base
from asyncrl_jax.infra import sharding
from asyncrl_jax.models.generate import generate
from asyncrl_jax.models.sampling import SamplingSettings
from asyncrl_jax.rl import scores
from asyncrl_jax.tokenization import TokenizerError


class EpisodeEvaluator:
  """Greedy accuracy and pass@1 over ``samples`` sampled episodes per problem (``Evaluator``'s
  interface: ``evaluate``, ``samples``, ``sampling``, ``last_samples``), and ``last_tools``: tool calls
  and tool errors per episode of the last evaluation."""

  def __init__(self, model_config, mesh, tokenizer, problems, *, episode: dict, max_prompt_len: int,
               max_new_tokens: int, samples: int = 0, sampling=None, seed: int = 0):
    if problems is None or jax.process_count() > 1:
      raise ValueError("held-out evaluation of episodes runs in a single learner process")
    self.model_config, self.mesh, self.tokenizer = model_config, mesh, tokenizer
    self.problems, self.episode = problems, episode
    self.max_new_tokens, self.max_prompt_len = max_new_tokens, max_prompt_len
    self.samples = samples if sampling is not None and sampling.temperature > 0 else 0
    self.sampling, self.seed = sampling, seed
    stops = self._new_env().stop
    ids = [tokenizer.encode(s) for s in stops]
    if len(stops) > 1 or (stops and len(ids[0]) != 1):
      raise ValueError(f"evaluating episodes needs an environment with at most one stop sequence, of "
                       f"one token; {episode['env']!r} stops at {stops!r} (tokens {ids})")
    self.stop_id = ids[0][0] if stops else tokenizer.eos_id
    if max_prompt_len + 2 * max_new_tokens > model_config.max_seq_len:
      raise ValueError(f"evaluating episodes decodes up to data.max_completion_len={max_new_tokens} "
                       f"tokens after contexts of up to data.max_prompt_len + data.max_completion_len: "
                       f"model.max_seq_len={model_config.max_seq_len} must be >= "
                       f"{max_prompt_len + 2 * max_new_tokens}")
    self.prompt_ids = [tokenizer.encode_prompt(p["question"]) for p in problems]
    for i, x in enumerate(self.prompt_ids):
      if len(x) > max_prompt_len:
        raise ValueError(f"eval problem {i} has {len(x)} prompt tokens > data.max_prompt_len")
    self.last_samples: list = []
    self.last_tools: dict = {}
    self._pool = futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="eval-env")

  @classmethod
  def from_config(cls, config, model_config, mesh, tokenizer, problems, *, episode: dict,
                  samples: Optional[int] = None):
    return cls(model_config, mesh, tokenizer, problems, episode=episode,
               max_prompt_len=config.data.max_prompt_len, max_new_tokens=config.data.max_completion_len,
               samples=config.data.eval_samples if samples is None else samples,
               sampling=SamplingSettings.from_config(config),
               seed=config.seed)

  def _new_env(self, episode_id: str = ""):
    return envs_base.make(self.episode["env"], context={"tokenizer": self.tokenizer,
                                                         "episode_id": episode_id},
                          **dict(self.episode.get("options") or {}))

  def evaluate(self, params, reward=None, version: Optional[int] = None) -> dict:
    """``{"greedy": acc, "sampled": pass@1 or None, "greedy_se", "sampled_se"}`` (``reward`` is
    unused: environments score; ``version`` picks the sampling key, as in ``Evaluator``)."""
    del reward
    greedy = self._run(params, 1, SamplingSettings(temperature=0.0), None)
    sampled = (self._run(params, self.samples, self.sampling, scores.eval_key(self.seed, version))
               if self.samples else None)
    return scores.figures(greedy, sampled, self.samples)

  def _decode(self, params, contexts: list, settings, key) -> tuple[np.ndarray, np.ndarray]:
    """One action of every episode: the policy continues each context (rows padded to the mesh's
    data ways); returns the new tokens and where each row's action ends."""
    ways = sharding.batch_ways(self.mesh)
    rows = -(-len(contexts) // ways) * ways
    batch = np.full((rows, self.max_prompt_len + self.max_new_tokens), self.tokenizer.pad_id, np.int32)
    lengths = np.ones(rows, np.int32)
    for i, ctx in enumerate(contexts):
      batch[i, :len(ctx)] = ctx
      lengths[i] = len(ctx)
    where = sharding.batch_sharding(self.mesh, 2), sharding.batch_sharding(self.mesh, 1)
    out = generate(self.model_config, params, jax.device_put(batch, where[0]),
                   jax.device_put(lengths, where[1]), key, max_new_tokens=self.max_new_tokens,
                   eos_id=self.stop_id, mesh=self.mesh, settings=settings)
    tokens, ends = (np.asarray(x) for x in jax.device_get(out))
    return tokens, ends

  def _run(self, params, copies: int, settings, key) -> np.ndarray:
    problems = [p for p in self.problems for _ in range(copies)]
    n = len(problems)
    envs = [self._new_env(f"eval-{k}") for k in range(len(problems))]
    # (side by side: an agent program's reset waits for its first request, which is the prompt)
    firsts = list(self._pool.map(lambda item: _reset(*item), zip(envs, problems)))
    prompts = [list(x) for x in self.prompt_ids for _ in range(copies)]
    completions = [[] for _ in range(n)]
    actions = [[] for _ in range(n)]  # 1 per policy token, 0 per observation token
    rewards = np.zeros(n, np.float32)
    active = np.ones(n, bool)
    calls = errors = 0
    for i, first in enumerate(firsts):
      if first is _FAILED or (isinstance(first, (list, tuple)) and not 0 < len(first) <= self.max_prompt_len):
        errors += 1  # (did not start, or its own prompt does not fit: scores 0, as on the decode servers)
        active[i] = False
      elif isinstance(first, (list, tuple)):  # the environment's own prompt
        prompts[i] = [int(t) for t in first]
    eos = set(self.tokenizer.stop_ids)
    max_turns = int(self.episode.get("max_turns") or 1)
    for turn in range(max_turns):
      if not active.any():
        break
      contexts = [prompts[i] + completions[i] if active[i] else prompts[i][:1] for i in range(n)]
      tokens, ends = self._decode(params, contexts, settings,
                                  None if key is None else jax.random.fold_in(key, turn))
      stepping = []
      for i in np.flatnonzero(active):
        action = tokens[i, :ends[i]].tolist()
        final = next((j for j, t in enumerate(action) if t in eos), None)
        if final is not None:
          action = action[:final + 1]
        room = self.max_new_tokens - len(completions[i])
        over = len(action) > room or (final is None and action[-1:] != [self.stop_id])
        completions[i] += action[:room]
        actions[i] += [1.0] * len(action[:room])
        if over:  # the token budget ran out inside the action: no answer
          active[i] = False
        else:
          stepping.append((i, self.tokenizer.decode(action)))
      # the environments step at once (slow tools wait side by side, as on the decode servers)
      outcomes = list(self._pool.map(lambda item: _step(envs[item[0]], item[1]), stepping))
      for (i, _), result in zip(stepping, outcomes):
        if result is None:  # the step raised: the episode scores 0; the count says so
          errors += 1
          active[i] = False
          continue
        rewards[i] += result.reward
        calls += "tool" in result.info
        errors += bool(result.info.get("error"))
        try:
          observation = ([] if result.done else self.tokenizer.encode(result.observation)
                         if isinstance(result.observation, str) else list(result.observation))
        except TokenizerError:  # (the decode servers end such an episode as env_error too)
          errors += 1
          active[i] = False
          continue
        if (result.done or turn + 1 == max_turns  # (the decode servers end such an episode too)
            or len(completions[i]) + len(observation) + 1 > self.max_new_tokens):
          active[i] = False
          continue
        completions[i] += observation
        actions[i] += [0.0] * len(observation)
    for env in envs:
      if hasattr(env, "close"):
        env.close()
    # (prompt ids, completion ids, reward, action mask: 0 on the environments' observations)
    self.last_samples = [(p, np.asarray(c, np.int32), float(r), np.asarray(a, np.float32))
                         for p, c, r, a in zip(prompts, completions, rewards, actions)]
    self.last_tools = {"tool_calls_per_episode": calls / max(n, 1), "tool_errors": errors}
    return rewards


_FAILED = object()


def _reset(env, problem: dict):
  """What ``env.reset`` returned, or ``_FAILED`` if it raised."""
  try:
    return env.reset(dict(problem))
  except Exception:  # pylint: disable=broad-except
    return _FAILED


def _step(env, action: str):
  """The environment's answer to ``action``, or None if it raised."""
  try:
    return env.step(action)
  except Exception:  # pylint: disable=broad-except
    return None

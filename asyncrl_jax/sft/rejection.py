"""Rejection-sampling fine-tuning (RFT): the supervised control for RL where demonstrations are missing.

Where the task has no demonstrations (``data.demo_max_terms``: none for the long chains RL trains on),
the best supervised use of the same compute is to train on the model's own correct samples. Each round:

1. draw ``samples`` completions for each of the next ``prompts_per_round`` training prompts, as the
   decode servers draw them (the run's temperature, top-k, top-p), with a new PRNG seed per round;
2. keep those with reward 1 that ended with EOS (``self_demonstrations``), added to a pool of every
   kept sample so far (duplicates once);
3. ``steps_per_round`` optimizer steps of the warm start's loss (``sft.nll_loss``, teacher forcing on
   the completion) on batches drawn from the pool.

It stops at a wall-time budget (the RL arm's, to compare at the same compute) or a step count. One
optimizer state for the whole run (constant learning rate), so no round recompiles anything.

  python -m asyncrl_jax.sft --rft --config=configs/long_chains.py --config.model.hf_path=WS \\
      --workdir=DIR --max_seconds=600 --evaluate
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from asyncrl_jax.learner import updater as update_lib
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.models.sampling import SamplingSettings
from asyncrl_jax.rl import batching
from asyncrl_jax.rl.evaluation import Evaluator
from asyncrl_jax.sft.supervised import nll_loss
from asyncrl_jax.tokenization import Tokenizer


def self_demonstrations(samples: Sequence[tuple], eos_id: int) -> list[batching.SequenceData]:
  """The kept samples as training sequences: (prompt ids, completion ids, reward[, action mask]) with
  reward 1 and a completion that ended with ``eos_id``; the loss is on the completion (EOS included),
  except an episode's observations (action mask 0)."""
  out = []
  for prompt, completion, reward, *actions in samples:
    completion = np.asarray(completion)
    if reward == 1.0 and len(completion) and completion[-1] == eos_id:
      out.append(batching.make_sequence(prompt, completion, action_mask=actions[0] if actions else None))
  return out


@dataclasses.dataclass
class RFTStats:
  rounds: int = 0
  steps: int = 0
  sampled: int = 0  # completions drawn
  kept: int = 0  # distinct correct completions in the pool
  sample_accuracy: list = dataclasses.field(default_factory=list)  # per round: share correct
  seconds: float = 0.0
  last_loss: Optional[float] = None  # the last step's (None before the first step)


def rejection_sampling_fine_tune(
    model_config: ModelConfig, params, mesh: Mesh, problems: Sequence[dict], tokenizer: Tokenizer,
    reward: Callable[[str, str], float], *, sampling: SamplingSettings, samples: int,
    prompts_per_round: int, steps_per_round: int, batch_size: int, learning_rate: float,
    token_budget: int, max_prompt_len: int, max_new_tokens: int, seed: int, max_steps: int,
    max_seconds: Optional[float] = None, grad_clip: float = 1.0,
    progress: Optional[Callable[[RFTStats, float], None]] = None, adapters_only: bool = False) -> tuple:
  """RFT rounds (module docstring) on ``problems`` (dicts with question, answer) until ``max_steps``
  optimizer steps or ``max_seconds`` of wall time (checked after each sampling and each step, every
  step waited for); returns ``(params, RFTStats)``. ``progress(stats, last loss)`` after each round.
  ``adapters_only``: train the LoRA adapters alone (as ``supervised.warm_start``)."""
  if not problems:
    raise ValueError("rejection sampling needs at least one training prompt")
  if samples < 1 or prompts_per_round < 1 or steps_per_round < 1 or max_steps < 1:
    raise ValueError(f"samples={samples}, prompts_per_round={prompts_per_round}, steps_per_round="
                     f"{steps_per_round} and max_steps={max_steps} must each be >= 1")
  if sampling.temperature <= 0:
    raise ValueError("rejection sampling needs sampled completions (rollout.temperature > 0)")
  if max_seconds is not None and not 0 < max_seconds < float("inf"):
    raise ValueError(f"max_seconds={max_seconds} must be a finite number > 0")
  if adapters_only and not model_config.lora:
    raise ValueError("adapters_only needs a model with LoRA adapters (model.lora.rank > 0)")
  optimizer = update_lib.make_optimizer(learning_rate=learning_rate, total_steps=max_steps,
                                        grad_clip=grad_clip, schedule="constant",
                                        adapters_only=adapters_only)
  updater = update_lib.Updater(model_config, params, mesh, optimizer, token_budget=token_budget,
                               losses={"nll": nll_loss(model_config, mesh)}, adapters_only=adapters_only)
  rng = np.random.default_rng(seed)
  stats, pool, seen = RFTStats(), [], set()
  t0, loss = time.time(), float("nan")
  out_of_time = lambda: max_seconds is not None and time.time() - t0 >= max_seconds
  while stats.steps < max_steps and not out_of_time():
    start = (stats.rounds * prompts_per_round) % len(problems)
    chunk = [problems[(start + i) % len(problems)] for i in range(min(prompts_per_round, len(problems)))]
    evaluator = Evaluator(model_config, mesh, tokenizer, chunk, max_prompt_len=max_prompt_len,
                          max_new_tokens=max_new_tokens, samples=samples, sampling=sampling,
                          seed=seed * 100_003 + stats.rounds)
    rewards = evaluator.sample(updater.params, reward)
    stats.rounds += 1
    stats.sampled += len(rewards)
    stats.sample_accuracy.append(float(np.mean(rewards)))
    for s in self_demonstrations(evaluator.last_samples, tokenizer.eos_id):
      key = s.tokens.tobytes()
      if key not in seen:
        seen.add(key)
        pool.append(s)
    stats.kept = len(pool)
    for _ in range(steps_per_round):
      if not pool or stats.steps >= max_steps or out_of_time():
        break
      batch = [pool[j] for j in rng.integers(0, len(pool), batch_size)]
      per_mb, _ = updater.update(*updater.place(batch), loss="nll")
      loss = float(jax.block_until_ready(sum(m["loss"] for m in per_mb)))
      stats.steps += 1
      stats.last_loss = loss
    stats.seconds = time.time() - t0
    if progress is not None:
      progress(stats, loss)
  return updater.params, stats

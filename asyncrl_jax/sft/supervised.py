"""Supervised warm start: next-token training on worked solutions, so RL starts from a model that is
right sometimes (all-fail groups carry no RL signal).

  python -m asyncrl_jax.sft --config=configs/default.py --workdir=DIR   # writes DIR/warm_start (HF)

``warm_start(...)`` is also called by the main job when ``learner.warm_start_steps > 0`` and no
checkpoint or ``model.hf_path`` is given.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from asyncrl_jax import models
from asyncrl_jax.learner import updater as update_lib
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.rl import batching
from asyncrl_jax.rl.logprobs import token_logprobs
from asyncrl_jax.tokenization import Tokenizer


def demonstration(tokenizer: Tokenizer, question: str, solution: str,
                  observation: Optional[tuple] = None) -> batching.SequenceData:
  """Prompt + solution + EOS; loss on the solution and EOS tokens only.

  ``observation`` = (open, close): the spans of the solution from an ``open`` marker to its
  ``close`` marker (both included) are what a tool answered, not what the policy writes: they are
  context (action mask 0, no loss), tokenized apart from the text around them as in an episode, so
  the warm start does not teach the policy to write the tool's answers itself."""
  if not observation:
    return batching.make_sequence(tokenizer.encode_prompt(question),
                                  tokenizer.encode(solution) + [tokenizer.eos_id])
  open_, close = observation
  tokens, actions, rest = [], [], solution
  while rest:
    start = rest.find(open_)
    end = rest.find(close, start + len(open_)) if start >= 0 else -1
    if start < 0 or end < 0:
      head, span, rest = rest, "", ""
    else:
      head, span, rest = rest[:start], rest[start:end + len(close)], rest[end + len(close):]
    for text, is_action in ((head, 1.0), (span, 0.0)):
      if text:
        ids = tokenizer.encode(text)
        tokens += ids
        actions += [is_action] * len(ids)
  return batching.make_sequence(tokenizer.encode_prompt(question), tokens + [tokenizer.eos_id],
                                action_mask=actions + [1.0])


def nll_loss(model_config: ModelConfig, mesh: Mesh):
  """The warm start's loss for the update loop: negative log-likelihood of the policy tokens (weighted
  by ``loss_weight``), normalised by the update's policy-token count."""
  def loss(params, b, _, normalizer):
    logp = token_logprobs(model_config, params, b.tokens, b.positions, b.segment_ids, mesh=mesh)
    return -jnp.sum(logp * b.mask * b.loss_weight) / normalizer, {}
  return loss


def warm_start(model_config: ModelConfig, params, mesh: Mesh, examples: Sequence[dict],
               tokenizer: Tokenizer, *, steps: int, batch_size: int, learning_rate: float, seed: int,
               token_budget: int, progress: Optional[Callable[[int, float], None]] = None,
               schedule: str = "cosine", max_seconds: Optional[float] = None, grad_clip: float = 1.0,
               observation: Optional[tuple] = None, adapters_only: bool = False):
  """Runs up to ``steps`` AdamW steps of teacher forcing on ``examples`` (dicts with question, solution).

  ``schedule``: ``cosine`` decays ``learning_rate`` to 10% over ``steps``; ``constant`` keeps it (for
  continuing a finished warm start at its final rate). ``max_seconds`` stops early at a wall-time budget
  (each step is then waited for, so the budget is measured, not dispatched). Gradients are clipped to
  global norm ``grad_clip``. Each step is one update of the shared update loop (``asyncrl_jax.learner.updater``,
  as the learner's): the batch is packed into fixed-shape micro-batches whose gradients are summed.
  ``observation``: the tool answers' markers in the solutions (``demonstration``; the run's are
  ``envs.observation_markers(config)``): no loss on what the tool answered.
  ``adapters_only`` (a model with LoRA adapters, ``learner.warm_start_train="adapters"``): only the
  adapters are trained, the base weights come back unchanged.
  Returns ``(params, last loss)``; the number of steps run is passed to ``progress`` last.
  """
  if not examples:
    raise ValueError("warm start needs at least one example")
  if not {"question", "solution"} <= set(examples[0]):
    raise ValueError(f"warm start examples need 'question' and 'solution' fields; got {sorted(examples[0])}")
  if steps < 1:
    raise ValueError(f"steps={steps} must be >= 1")
  if max_seconds is not None and not 0 < max_seconds < float("inf"):
    raise ValueError(f"max_seconds={max_seconds} must be a finite number > 0")
  if adapters_only and not model_config.lora:
    raise ValueError("adapters_only needs a model with LoRA adapters (model.lora.rank > 0)")
  optimizer = update_lib.make_optimizer(learning_rate=learning_rate, total_steps=steps,
                                        grad_clip=grad_clip, schedule=schedule,
                                        adapters_only=adapters_only)
  updater = update_lib.Updater(model_config, params, mesh, optimizer, token_budget=token_budget,
                               losses={"nll": nll_loss(model_config, mesh)},
                               adapters_only=adapters_only)
  rng = np.random.default_rng(seed)
  sequences = {}  # example index -> its tokenized demonstration (examples recur across steps)
  t0 = time.time()
  for i in range(steps):
    idx = rng.integers(0, len(examples), batch_size)
    for j in idx:
      if j not in sequences:
        sequences[j] = demonstration(tokenizer, examples[j]["question"], examples[j]["solution"],
                                     observation)
    per_mb, _ = updater.update(*updater.place([sequences[j] for j in idx]), loss="nll")
    loss = sum(m["loss"] for m in per_mb)
    out_of_time = False
    if max_seconds is not None:
      jax.block_until_ready(loss)
      out_of_time = time.time() - t0 >= max_seconds
    if progress is not None and (i % 10 == 0 or i == steps - 1 or out_of_time):
      progress(i + 1, float(loss))
    if out_of_time:
      break
  return updater.params, float(loss)

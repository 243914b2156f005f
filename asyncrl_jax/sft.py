"""Supervised warm start: next-token training on worked solutions, so RL starts from a model that is
right sometimes (all-fail groups carry no RL signal).

  python -m asyncrl_jax.sft --config=configs/default.py --workdir=DIR   # writes DIR/warm_start (HF)

``warm_start(...)`` is also called by the main job when ``learner.warm_start_steps > 0`` and no
checkpoint or ``model.hf_path`` is given.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from asyncrl_jax import models
from asyncrl_jax import sharding as sharding_lib
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.rl import batching
from asyncrl_jax.rl.logprobs import token_logprobs
from asyncrl_jax.tokenization import Tokenizer


def demonstration(tokenizer: Tokenizer, question: str, solution: str) -> batching.SequenceData:
  """Prompt + solution + EOS; loss on the solution and EOS tokens only."""
  prompt = tokenizer.encode_prompt(question)
  completion = tokenizer.encode(solution) + [tokenizer.eos_id]
  n = len(prompt) + len(completion)
  mask = np.r_[np.zeros(len(prompt)), np.ones(len(completion))].astype(np.float32)
  return batching.SequenceData(np.asarray(prompt + completion, np.int32), mask,
                               np.zeros(n, np.float32), np.zeros(n, np.float32), np.full(n, -1, np.int32))


def warm_start(model_config: ModelConfig, params, mesh: Mesh, examples: Sequence[dict],
               tokenizer: Tokenizer, *, steps: int, batch_size: int, learning_rate: float, seed: int,
               token_budget: int, progress: Optional[Callable[[int, float], None]] = None):
  """Runs ``steps`` AdamW steps of teacher forcing on ``examples`` (dicts with question, solution)."""
  if not examples:
    raise ValueError("warm start needs at least one example")
  shardings = models.param_shardings(model_config, mesh)
  params = jax.device_put(params, shardings)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(optax.cosine_decay_schedule(learning_rate, max(steps, 1), 0.1)))
  opt_state = jax.jit(optimizer.init)(params)
  rows_multiple = mesh.shape["data"] * mesh.shape["fsdp"]

  def loss_fn(p, b, normalizer):
    logp = token_logprobs(model_config, p, b.tokens, b.positions, b.segment_ids, mesh=mesh)
    return -jnp.sum(logp * b.mask) / normalizer

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(p, s, batches, normalizer):
    loss, grads = 0.0, None
    for b in batches:
      l, g = jax.value_and_grad(loss_fn)(p, b, normalizer)
      loss += l
      grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    updates, s = optimizer.update(grads, s, p)
    return optax.apply_updates(p, updates), s, loss

  rng = np.random.default_rng(seed)
  batch_sharding = sharding_lib.batch_sharding(mesh, 2)
  loss = float("nan")
  for i in range(steps):
    idx = rng.integers(0, len(examples), batch_size)
    seqs = [demonstration(tokenizer, examples[j]["question"], examples[j]["solution"]) for j in idx]
    mbs = batching.pack_sequences(seqs, token_budget)
    normalizer = jnp.float32(batching.total_policy_tokens(mbs))
    device_mbs = tuple(jax.device_put(batching.pad_rows(b, rows_multiple), batch_sharding) for b in mbs)
    params, opt_state, loss_arr = step(params, opt_state, device_mbs, normalizer)
    if progress is not None and (i % 10 == 0 or i == steps - 1):
      loss = float(loss_arr)
      progress(i + 1, loss)
  return params, float(loss)


def main(argv=None) -> None:
  from asyncrl_jax import cli  # pylint: disable=import-outside-toplevel
  cli.ensure_cpu_devices(4)
  import os  # pylint: disable=import-outside-toplevel
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  from asyncrl_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.data import builder as builder_lib, pipeline  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tokenization import load_tokenizer  # pylint: disable=import-outside-toplevel

  config_flag = cli.define_config_flag()
  workdir = flags.DEFINE_string("workdir", None, "Output directory.")

  def _main(args):
    del args
    config = cli.validated(config_flag.value)
    if not workdir.value:
      raise app.UsageError("--workdir is required")
    model_config = config_lib.model_config(config)
    mesh = sharding_lib.make_mesh(jax.devices(), dict(data=1, fsdp=-1, tensor=1))
    b = builder_lib.build_arithmetic(os.path.join(workdir.value, "data"), num_train=config.data.num_train,
                                     num_test=config.data.num_test, seed=config.seed,
                                     min_terms=config.data.min_terms, max_terms=config.data.max_terms)
    examples = pipeline.read_split(b, "train")
    params = models.init_params(model_config, jax.random.key(config.seed), mesh=mesh)
    t = time.time()
    params, loss = warm_start(
        model_config, params, mesh, examples, load_tokenizer(config.data.tokenizer_path),
        steps=max(config.learner.warm_start_steps, 1), batch_size=config.learner.warm_start_batch,
        learning_rate=config.learner.warm_start_lr, seed=config.seed,
        token_budget=config.learner.token_budget,
        progress=lambda i, l: print(f"[sft] step {i} loss {l:.3f}", flush=True))
    out = os.path.join(workdir.value, "warm_start")
    models.export_hf(model_config, params, out)
    print(f"[sft] {time.time() - t:.0f}s, final loss {loss:.3f}; exported to {out}")

  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()

"""The main job: ``python -m asyncrl_jax.train --config=configs/default.py --workdir=DIR``.

Status: the asynchronous RL loop (controller, decode servers, learner, weight transfer, checkpoints) is
not built yet. Until it is, this entry point runs the pieces that exist, in the order the loop will use
them, and says so:

  setup -> meshes (rollout : learner split) -> model initialised sharded on the learner mesh (or loaded
  from ``model.hf_path``) -> weights moved to the rollout mesh -> greedy KV-cache decoding of built-in
  problems on the rollout mesh -> exact-answer rewards -> ``WORKDIR/summary.json``.
"""

from __future__ import annotations

from asyncrl_jax import cli

cli.ensure_cpu_devices(4)

# pylint: disable=wrong-import-position
import json
import os
import sys
import time

import jax
import numpy as np
from absl import app, flags

from asyncrl_jax import config as config_lib
from asyncrl_jax import models, sharding
from asyncrl_jax.data import arithmetic
from asyncrl_jax.models.generate import greedy_generate
from asyncrl_jax.tokenization import load_tokenizer

_CONFIG = cli.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, checkpoints and summaries.")
_NUM_PROBLEMS = flags.DEFINE_integer("num_problems", 16, "Built-in problems to decode in the demo.")


def _log(msg: str) -> None:
  print(f"[asyncrl_jax] {msg}", flush=True)


def run(config, workdir: str, num_problems: int) -> dict:
  """Runs what exists of the pipeline; returns the summary it writes."""
  t0 = time.time()
  os.makedirs(workdir, exist_ok=True)

  # Meshes: one per role.
  rollout_devices, learner_devices = sharding.split_devices(jax.devices(), config.mesh.rollout_fraction)
  learner_mesh = sharding.make_mesh(learner_devices, config.mesh.learner.to_dict(), role="mesh.learner")
  rollout_mesh = sharding.make_mesh(rollout_devices, config.mesh.rollout.to_dict(), role="mesh.rollout")
  _log(f"devices: {len(jax.devices())} x {jax.devices()[0].platform}; "
       f"learner mesh {sharding.describe(learner_mesh)}; rollout mesh {sharding.describe(rollout_mesh)}")

  # Model: created already sharded on the learner mesh.
  if config.model.hf_path:
    model_config, params = models.load_hf(config.model.hf_path, mesh=learner_mesh,
                                          dtype=config.model.param_dtype)
  else:
    model_config = config_lib.model_config(config)
    params = models.init_params(model_config, jax.random.key(config.seed), mesh=learner_mesh)
  _log(f"model: {models.count_params(params):,} parameters, {model_config.num_layers} layers, "
       f"d={model_config.hidden_size}")

  # Weights to the rollout mesh (the in-process weight transfer).
  t = time.time()
  rollout_params = jax.block_until_ready(
      jax.device_put(params, models.param_shardings(model_config, rollout_mesh)))
  transfer_s = time.time() - t
  _log(f"weights -> rollout mesh in {transfer_s * 1e3:.1f} ms")

  # Greedy decoding of built-in problems on the rollout mesh.
  tokenizer = load_tokenizer(config.data.tokenizer_path)
  rng = np.random.default_rng(config.seed)
  problems = [arithmetic.make_problem(rng, config.data.min_terms, config.data.max_terms)
              for _ in range(num_problems)]
  prompts = [tokenizer.encode_prompt(p.question) for p in problems]
  longest = max(len(p) for p in prompts)
  if longest > config.data.max_prompt_len:
    raise ValueError(f"a prompt has {longest} tokens > data.max_prompt_len={config.data.max_prompt_len}")
  rows = -(-num_problems // rollout_mesh.devices.size) * rollout_mesh.devices.size
  prompt_bp = np.full((rows, config.data.max_prompt_len), tokenizer.pad_id, np.int32)
  prompt_len = np.ones(rows, np.int32)
  for i, p in enumerate(prompts):
    prompt_bp[i, :len(p)] = p
    prompt_len[i] = len(p)
  t = time.time()
  tokens, lengths = greedy_generate(
      model_config, rollout_params, jax.device_put(prompt_bp, sharding.batch_sharding(rollout_mesh)),
      jax.device_put(prompt_len, sharding.batch_sharding(rollout_mesh, 1)),
      max_new_tokens=config.data.max_completion_len, eos_id=tokenizer.eos_id, mesh=rollout_mesh)
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  decode_s = time.time() - t
  rewards = []
  for i, problem in enumerate(problems):
    text = tokenizer.decode(tokens[i, :lengths[i]])
    rewards.append(arithmetic.reward(text, problem.answer))
    if i < 3:
      _log(f"  {problem.question!r} -> {text[:40]!r} (answer {problem.answer}, reward {rewards[-1]})")

  summary = {
      "status": "partial: the asynchronous RL loop is not built yet; ran setup, sharded init, "
                "weight transfer and greedy decoding",
      "devices": len(jax.devices()),
      "learner_mesh": dict(learner_mesh.shape),
      "rollout_mesh": dict(rollout_mesh.shape),
      "num_params": models.count_params(params),
      "weight_transfer_s": transfer_s,
      "decode_s_incl_compile": decode_s,
      "problems": num_problems,
      "greedy_accuracy": float(np.mean(rewards)),
      "max_staleness": int(config.rl.max_staleness),
      "loss": config.rl.loss,
      "wall_seconds": time.time() - t0,
  }
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  _log(f"untrained greedy accuracy {summary['greedy_accuracy']:.2f} on {num_problems} problems; "
       f"summary in {os.path.join(workdir, 'summary.json')}")
  return summary


def main(argv=None) -> None:
  def _main(args):
    if len(args) > 1:
      raise app.UsageError(f"unexpected arguments: {args[1:]}")
    config = cli.validated(_CONFIG.value)
    if not _WORKDIR.value:
      print("error: --workdir is required", file=sys.stderr)
      sys.exit(2)
    run(config, _WORKDIR.value, _NUM_PROBLEMS.value)

  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()

"""The main job: ``python -m asyncrl_jax.train --config=configs/default.py --workdir=DIR``.

setup -> meshes (rollout : learner split of the devices) -> data (TFDS array_record + grain) -> model
and learner (resume from DIR/checkpoints, else ``model.hf_path``, else random init + supervised warm
start) -> decode server (rollout mesh, its own thread) + controller (staleness-bounded admission,
rewards, batches) -> loop: batch -> update -> publish version v+1 -> checkpoint / evaluate -> summary.

Writes ``DIR/metrics.jsonl``, TensorBoard events in ``DIR/tb``, ``DIR/progress.png``,
``DIR/trained_prompts.jsonl`` and ``DIR/summary.json`` (``runlog.RunLog``). Killed at any point, the
same command resumes from the last checkpoint (``checkpoint.RunCheckpointer``).
"""

from __future__ import annotations

from asyncrl_jax import cli

cli.ensure_cpu_devices(4)

# pylint: disable=wrong-import-position
import dataclasses
import os
import sys
import time

from absl import app, flags, logging

from asyncrl_jax import models, sharding
from asyncrl_jax.checkpoint import RunCheckpointer
from asyncrl_jax.controller import Controller
from asyncrl_jax.data import builder as builder_lib
from asyncrl_jax.data import pipeline
from asyncrl_jax.evaluation import Evaluator, eval_kind, primary
from asyncrl_jax.learner import Learner
from asyncrl_jax.rewards import reward_fn
from asyncrl_jax.rollout.backends import LocalRollout, RemoteRollout
from asyncrl_jax.rollout.engine import engine_from_config
from asyncrl_jax.runlog import RunLog, say
from asyncrl_jax.sft import warm_start
from asyncrl_jax.tokenization import load_tokenizer
from asyncrl_jax.transfer import local_transfer

_CONFIG = cli.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and summaries.")


@dataclasses.dataclass
class _Data:
  builder: object
  tokenizer: object
  reward: object
  eval_problems: list
  prompts: pipeline.PromptStream

  @classmethod
  def from_config(cls, config, workdir: str) -> "_Data":
    builder = builder_lib.from_config(config, workdir)
    return cls(builder, load_tokenizer(config.data.tokenizer_path), reward_fn(config.data.task),
               pipeline.read_split(builder, builder_lib.held_out_split(builder), config.data.eval_problems),
               pipeline.PromptStream(builder.as_data_source(split="train"), seed=config.seed))


class _Evaluation:
  """Held-out evaluation on the rollout mesh (or the learner's when decode servers are remote)."""

  def __init__(self, config, model_config, meshes: sharding.RoleMeshes, data: _Data):
    mesh = meshes.rollout or meshes.learner
    self.shardings = models.param_shardings(model_config, mesh)
    self.evaluator = Evaluator.from_config(config, model_config, mesh, data.tokenizer, data.eval_problems)
    self.reward = data.reward
    self.kind = eval_kind(self.evaluator)

  def __call__(self, learner_params, rollout_params=None) -> tuple[float, float]:
    """(primary accuracy, greedy accuracy) of the params (the decode server's copy when given)."""
    params = rollout_params if rollout_params is not None else local_transfer(learner_params,
                                                                              self.shardings)[0]
    result = self.evaluator.evaluate(params, self.reward)
    return primary(result), result["greedy"]


def _warm_start(config, learner: Learner, data: _Data, evaluate: _Evaluation) -> dict:
  """Supervised warm start of a randomly initialised policy; returns its meta figures."""
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  meta = {"untrained_eval_accuracy": evaluate(learner.params)[0]}
  t = time.time()
  bar = tqdm(total=config.learner.warm_start_steps, desc="warm start (supervised)", unit="step",
             file=sys.stdout, dynamic_ncols=True)

  def progress(step, loss):
    bar.update(step - bar.n)
    bar.set_postfix(loss=f"{loss:.3f}")

  learner.params, meta["warm_start_loss"] = warm_start(
      learner.model_config, learner.params, learner.mesh, pipeline.read_split(data.builder, "train"),
      data.tokenizer, steps=config.learner.warm_start_steps, batch_size=config.learner.warm_start_batch,
      learning_rate=config.learner.warm_start_lr, seed=config.seed,
      token_budget=config.learner.token_budget, progress=progress, grad_clip=config.learner.grad_clip)
  bar.close()  # the RL optimizer state is still the untouched initial one
  meta["warm_start_seconds"] = time.time() - t
  return meta


def _policy(config, meshes, data: _Data, ckpt: RunCheckpointer, log: RunLog):
  """The learner, restored from the last checkpoint or initialised (and warm-started), with the
  held-out accuracy it starts RL from; returns (learner, evaluation, engine or None, meta)."""
  model_config, params = models.from_config(config, meshes.learner)
  learner = Learner(model_config, params, meshes.learner, config, total_steps=config.steps)
  del params
  engine = engine_from_config(config, meshes.rollout, model_config) if meshes.rollout else None
  if engine is not None and config.rollout.warm_up:
    engine.warm_up()  # in the background, during evaluation and warm start
  evaluate = _Evaluation(config, model_config, meshes, data)
  meta = ckpt.restore_run(learner, data.prompts)
  if meta is not None:
    log.resume(learner.version)
    say(f"resumed from checkpoint at policy version {learner.version}")
  else:
    log.start_fresh()
    meta = (_warm_start(config, learner, data, evaluate)
            if config.learner.warm_start_steps and not config.model.hf_path else {})
  if "initial_eval_greedy_accuracy" not in meta:  # (a checkpoint from before pass@1: measure both)
    meta.pop("last_eval_accuracy", None)
    meta["initial_eval_accuracy"], meta["initial_eval_greedy_accuracy"] = evaluate(learner.params)
  say(f"model {models.count_params(learner.params):,} params; held-out accuracy "
      f"{meta['initial_eval_accuracy']:.3f} ({evaluate.kind}), greedy "
      f"{meta['initial_eval_greedy_accuracy']:.3f} at version {learner.version}")
  return learner, evaluate, engine, meta


def _rollout(config, meshes, engine, learner: Learner):
  """The decode servers' backend, holding the learner's current weights (not started)."""
  if meshes.remote:
    backend = RemoteRollout(meshes.remote, transfer_host=config.rollout.host)
    transfer = backend.update_weights(learner.params, learner.version)  # servers start with no weights
    say(f"pushed version {learner.version} to {len(meshes.remote)} decode servers in "
        f"{transfer.seconds:.2f}s")
    return backend
  return LocalRollout(engine, learner.params, learner.version,
                      on_weight_update=config.rollout.on_weight_update)


def _train(config, learner, controller, backend, evaluate, log: RunLog, ckpt, meta: dict):
  """The RL loop: one policy version per batch, until ``config.steps``; returns the last accuracies."""
  accuracy = (meta.get("last_eval_accuracy", meta["initial_eval_accuracy"]),
              meta.get("last_eval_greedy_accuracy", meta["initial_eval_greedy_accuracy"]))
  log.start_rl(learner.version, backend.decode_stats())
  controller.pump()
  while learner.version < config.steps:
    if backend.error is not None:
      raise RuntimeError(f"rollout failed: {backend.error!r}")
    batch = controller.next_batch(learner.version, timeout=5.0)
    if batch is None:
      continue
    update = learner.train(batch.sequences, version=batch.version)
    transfer = backend.update_weights(learner.params, learner.version)
    controller.pump()
    record = log.version_record(batch, update, transfer, backend.decode_stats())
    last = learner.version == config.steps
    if learner.version % config.learner.eval_every == 0 or last:
      accuracy = evaluate(learner.params, getattr(backend, "rollout_params", None))
      record.update(eval_accuracy=accuracy[0], eval_greedy_accuracy=accuracy[1])
    log.append(record, batch)
    if learner.version % config.checkpoint.every_steps == 0 or last:
      meta.update(last_eval_accuracy=accuracy[0], last_eval_greedy_accuracy=accuracy[1])
      ckpt.save_run(learner, controller, meta)
  return accuracy


def run(config, workdir: str) -> dict:
  log = RunLog(workdir, config)
  meshes = sharding.role_meshes(config)
  say(meshes.describe())
  data = _Data.from_config(config, workdir)
  ckpt = RunCheckpointer(os.path.join(workdir, "checkpoints"), max_to_keep=config.checkpoint.max_to_keep,
                         async_save=config.checkpoint.async_save)
  learner, evaluate, engine, meta = _policy(config, meshes, data, ckpt, log)
  backend = _rollout(config, meshes, engine, learner)
  controller = Controller.from_config(config, prompts=data.prompts, tokenizer=data.tokenizer,
                                      submit=backend.submit, version=lambda: backend.version,
                                      reward=data.reward, num_servers=len(meshes.remote) or 1)
  if config.rollout.warm_up:
    t = time.time()
    say("waiting for the decode servers to compile their prefill shapes (rollout.warm_up)")
    backend.wait_until_warm()
    say(f"decode servers warm after {time.time() - t:.1f}s")
  backend.start(controller.on_trajectory)
  try:
    final = _train(config, learner, controller, backend, evaluate, log, ckpt, meta)
  finally:
    log.close()
    backend.stop()
    controller.close()
    ckpt.close()
  summary = log.summary(
      meta, final_eval_accuracy=final[0], final_eval_greedy_accuracy=final[1], eval_metric=evaluate.kind,
      steps=learner.version, duplicates_dropped=controller.duplicates, failed_rollouts=controller.failed,
      devices={"rollout": dict(meshes.rollout.shape) if meshes.rollout else meshes.remote,
               "learner": dict(meshes.learner.shape)})
  log.finish(summary)
  return summary


def main(argv=None) -> None:
  def _main(args):
    if len(args) > 1:
      raise app.UsageError(f"unexpected arguments: {args[1:]}")
    config = cli.validated(_CONFIG.value)
    if not _WORKDIR.value:
      print("error: --workdir is required", file=sys.stderr)
      sys.exit(2)
    logging.set_verbosity(logging.WARNING)
    run(config, _WORKDIR.value)

  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()

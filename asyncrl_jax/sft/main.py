"""``python -m asyncrl_jax.sft --config=configs/default.py --workdir=DIR``: the supervised warm start
(``supervised.warm_start`` on demonstrations, or ``--rft``: ``rejection.rejection_sampling_fine_tune``
on the model's own correct samples), exported to ``DIR/warm_start`` in Hugging Face format."""

from __future__ import annotations

import time
from typing import Optional

import jax

from asyncrl_jax import envs, models
from asyncrl_jax.infra import sharding as sharding_lib
from asyncrl_jax.sft.supervised import warm_start


def _fine_tune(config, model_config, params, mesh, builder, tokenizer, workdir: str, *,
               learning_rate: float, schedule: str, max_seconds: Optional[float],
               rft: Optional[dict]) -> tuple:
  """The CLI's training: on demonstrations (``warm_start``), or, with ``rft`` (the ``samples``,
  ``prompts_per_round`` and ``steps_per_round`` of ``asyncrl_jax.sft.rejection``), on the model's own correct
  samples of the train split's prompts. Prints progress; returns (params, last loss, steps, summary
  fields)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.data import builder as builder_lib, pipeline  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.models.sampling import SamplingSettings  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.rl.rewards import reward_fn  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.sft.rejection import rejection_sampling_fine_tune  # pylint: disable=import-outside-toplevel
  steps = max(config.learner.warm_start_steps, 1)
  common = dict(learning_rate=learning_rate, token_budget=config.learner.token_budget,
                max_seconds=max_seconds, grad_clip=config.learner.grad_clip,
                batch_size=config.learner.warm_start_batch, seed=config.seed,
                adapters_only=config.learner.warm_start_train == "adapters")
  if rft is None:
    steps_run = [0]

    def progress(i, loss):
      steps_run[0] = i
      print(f"[sft] step {i} loss {loss:.3f}", flush=True)

    params, loss = warm_start(
        model_config, params, mesh,
        pipeline.read_split(builder_lib.demonstrations_from_config(config, workdir), "train"),
        tokenizer, steps=steps, progress=progress, schedule=schedule,
        observation=envs.observation_markers(config), **common)
    return params, loss, steps_run[0], {}

  def rft_progress(stats, loss):
    print(f"[sft] rft round {stats.rounds}: {stats.steps} steps, {stats.kept} of {stats.sampled} "
          f"samples kept, sample accuracy {stats.sample_accuracy[-1]:.3f}, loss {loss:.3f}", flush=True)

  params, stats = rejection_sampling_fine_tune(
      model_config, params, mesh, pipeline.read_split(builder, "train"), tokenizer,
      reward_fn(config.data.task), sampling=SamplingSettings.from_config(config),
      max_prompt_len=config.data.max_prompt_len, max_new_tokens=config.data.max_completion_len,
      max_steps=steps, progress=rft_progress, **rft, **common)
  loss = stats.last_loss if stats.last_loss is not None else float("nan")
  return params, loss, stats.steps, {"rft": dataclasses.asdict(stats)}


def main(argv=None) -> None:
  from asyncrl_jax import cli  # pylint: disable=import-outside-toplevel
  cli.ensure_cpu_devices(4)
  import json  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.data import builder as builder_lib, pipeline  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.rl.evaluation import eval_kind, evaluator_for, final_size, primary  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.rl.rewards import reward_fn  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tokenization import tokenizer_of  # pylint: disable=import-outside-toplevel

  config_flag = cli.define_config_flag()
  workdir = flags.DEFINE_string("workdir", None, "Output directory.")
  max_seconds = flags.DEFINE_float("max_seconds", None, "Also stop after this much training wall time "
                                    "(whichever comes first: learner.warm_start_steps or this).")
  schedule = flags.DEFINE_enum("schedule", "cosine", ["cosine", "constant"],
                               "Learning-rate schedule (constant: continue a warm start at 10% of "
                               "learner.warm_start_lr, its final rate).")
  evaluate = flags.DEFINE_bool("evaluate", False, "Held-out accuracy before and after, as the main job "
                               "evaluates its last version (data.final_eval_problems x final_eval_samples "
                               "when set), with standard errors; written to WORKDIR/sft_summary.json.")
  rft = flags.DEFINE_bool("rft", False, "Rejection-sampling fine-tuning instead of demonstrations: "
                          "train on the model's own correct samples of the RL prompts (asyncrl_jax.sft.rejection), "
                          "at the constant rate of --schedule=constant.")
  rft_samples = flags.DEFINE_integer("rft_samples", 4, "--rft: completions drawn per prompt.")
  rft_prompts = flags.DEFINE_integer("rft_prompts_per_round", 128, "--rft: prompts sampled per round.")
  rft_steps = flags.DEFINE_integer("rft_steps_per_round", 16, "--rft: optimizer steps per round.")

  def _main(args):
    del args
    config = cli.validated(config_flag.value)
    if not workdir.value:
      raise app.UsageError("--workdir is required")
    mesh = sharding_lib.make_mesh(jax.devices(), dict(data=1, fsdp=-1, tensor=1))
    b = builder_lib.from_config(config, workdir.value)
    tokenizer = tokenizer_of(config)
    model_config, params = models.from_config(config, mesh)  # model.hf_path: continue from it
    constant = schedule.value == "constant" or rft.value
    lr = config.learner.warm_start_lr * (0.1 if constant else 1.0)
    summary = dict(schedule="constant" if constant else schedule.value, learning_rate=lr,
                   init=config.model.hf_path or "random", mode="rft" if rft.value else "demonstrations")
    evaluator = None
    if evaluate.value:
      problems, samples = final_size(config)  # (what a run's last version is evaluated on)
      evaluator = evaluator_for(
          config, model_config, mesh, tokenizer,
          pipeline.read_split(b, builder_lib.held_out_split(b), problems), samples=samples)
      before = evaluator.evaluate(params, reward_fn(config.data.task))
      summary.update(eval_metric=eval_kind(evaluator), eval_problems=len(evaluator.prompt_ids),
                     initial_eval_accuracy=primary(before), initial_eval_greedy_accuracy=before["greedy"])
    t = time.time()
    params, loss, steps, extra = _fine_tune(
        config, model_config, params, mesh, b, tokenizer, workdir.value, learning_rate=lr,
        schedule=schedule.value, max_seconds=max_seconds.value,
        rft=dict(samples=rft_samples.value, prompts_per_round=rft_prompts.value,
                 steps_per_round=rft_steps.value) if rft.value else None)
    summary.update(extra)
    summary.update(seconds=time.time() - t, steps=steps, final_loss=loss)
    out = os.path.join(workdir.value, "warm_start")
    models.export_hf(model_config, params, out)
    if evaluator is not None:
      after = evaluator.evaluate(params, reward_fn(config.data.task))
      summary.update(final_eval_accuracy=primary(after), final_eval_greedy_accuracy=after["greedy"],
                     final_eval_accuracy_se=after["sampled_se"] if after["sampled"] is not None else
                     after["greedy_se"], final_eval_greedy_accuracy_se=after["greedy_se"])
    with open(os.path.join(workdir.value, "sft_summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
    print(f"[sft] {summary['seconds']:.0f}s, {summary['steps']} steps, final loss {loss:.3f}; exported "
          f"to {out}" + (f"; held-out accuracy {summary['initial_eval_accuracy']:.3f} -> "
                         f"{summary['final_eval_accuracy']:.3f}" if evaluator is not None else ""))

  app.run(_main, argv=argv, flags_parser=cli.parse_flags)


if __name__ == "__main__":
  main()

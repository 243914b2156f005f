"""The main job: ``python -m asyncrl_jax.train --config=configs/default.py --workdir=DIR``.

setup -> meshes (rollout : learner split of the devices) -> data (TFDS array_record + grain) -> model
(resume from DIR/checkpoints, else ``model.hf_path``, else random init + supervised warm start) ->
learner (learner mesh) -> decode server (rollout mesh, its own thread) -> controller (staleness-bounded
admission, rewards, batches) -> loop: batch -> update -> publish version v+1 -> checkpoint / evaluate.

Writes ``DIR/metrics.jsonl``, TensorBoard events in ``DIR/tb``, ``DIR/progress.png``,
``DIR/trained_prompts.jsonl`` and ``DIR/summary.json``. Killed at any point, the same command resumes
from the last checkpoint.
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
from absl import app, flags, logging

from asyncrl_jax import models, sharding
from asyncrl_jax.checkpoint import Checkpointer
from asyncrl_jax.controller import Controller
from asyncrl_jax.data import builder as builder_lib
from asyncrl_jax.data import pipeline
from asyncrl_jax import learner as learner_lib
from asyncrl_jax.learner import Learner
from asyncrl_jax.evaluation import Evaluator, eval_kind, primary
from asyncrl_jax.rewards import reward_fn
from asyncrl_jax.rl.staleness import StalenessManager
from asyncrl_jax.rollout.engine import engine_from_config
from asyncrl_jax.rollout.backends import LocalRollout, RemoteRollout
from asyncrl_jax.rollout.stats import DecodeStats
from asyncrl_jax.sft import warm_start
from asyncrl_jax.tokenization import load_tokenizer
from asyncrl_jax.transfer import local_transfer

_CONFIG = cli.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and summaries.")


def _say(msg: str) -> None:
  print(f"[asyncrl_jax] {msg}", flush=True)


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = v
  return out


def _record_config(config, path: str) -> None:
  """Writes the run's full config to ``path``; a rerun in the same directory with other values says
  which (a resume continues from the checkpoint either way)."""
  new = json.loads(config.to_json_best_effort())
  if os.path.exists(path):
    with open(path) as f:
      old = _flat(json.load(f))
    flat = _flat(new)
    changed = sorted(k for k, v in flat.items() if old.get(k, v) != v)
    if changed:
      _say("config differs from this directory's previous run: " + ", ".join(
          f"{k}={old[k]!r} -> {flat[k]!r}" for k in changed))
  with open(path, "w") as f:
    json.dump(new, f, indent=2)


def _truncate_jsonl(path: str, keep) -> None:
  """Keeps the records of ``path`` that ``keep`` accepts (those up to the checkpoint resumed from).

  A last line without its newline is a record cut short by a kill. Records are written before the
  checkpoint of their version, so it is always one the resume drops anyway; any other unreadable line
  is an error.
  """
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = f.readlines()
  kept = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    if i == len(lines) - 1 and not line.endswith("\n"):
      _say(f"dropping a record cut short at the end of {path}")
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}, line {i + 1}: not a JSON record ({e}); the log is damaged") from e
    if keep(record):
      kept.append(line)
  with open(path, "w") as f:
    f.writelines(kept)


def _append_jsonl(path: str, record: dict) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


def run(config, workdir: str) -> dict:
  t_start = time.time()
  os.makedirs(workdir, exist_ok=True)
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  prompts_path = os.path.join(workdir, "trained_prompts.jsonl")
  _record_config(config, os.path.join(workdir, "config.json"))

  # --- meshes: one per role (all local devices learn when decode servers are other processes)
  remote = [a.strip() for a in config.rollout.addresses.split(",") if a.strip()]
  if remote:
    rollout_devices, learner_devices = [], list(jax.devices())
  elif config.mesh.colocate:  # both roles on every device, taking turns
    rollout_devices = learner_devices = list(jax.devices())
  else:
    rollout_devices, learner_devices = sharding.split_devices(jax.devices(),
                                                              config.mesh.rollout_fraction)
  learner_mesh = sharding.make_mesh(learner_devices, config.mesh.learner.to_dict(), role="mesh.learner")
  rollout_mesh = (sharding.make_mesh(rollout_devices, config.mesh.rollout.to_dict(), role="mesh.rollout")
                  if rollout_devices else None)
  _say(f"{len(jax.devices())} {jax.devices()[0].platform} devices: learner {sharding.describe(learner_mesh)}"
       + (f", rollout {sharding.describe(rollout_mesh)}"
          + (" (the same devices, taking turns)" if config.mesh.colocate else "") if rollout_mesh else
          f"; decode servers at {', '.join(remote)}"))

  # --- data
  builder = builder_lib.from_config(config, workdir)
  tokenizer = load_tokenizer(config.data.tokenizer_path)
  reward = reward_fn(config.data.task)
  eval_problems = pipeline.read_split(builder, builder_lib.held_out_split(builder),
                                      config.data.eval_problems)
  prompts = pipeline.PromptStream(builder.as_data_source(split="train"), seed=config.seed)

  # --- model (resume > hf_path > random init + warm start)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=config.checkpoint.max_to_keep,
                      async_save=config.checkpoint.async_save)
  latest = ckpt.latest_step()
  model_config, params = models.from_config(config, learner_mesh)
  learner = Learner(model_config, params, learner_mesh, config, total_steps=config.steps)
  meta = {}
  if latest is not None:
    learner.params, learner.opt_state, meta = ckpt.restore(latest, params_like=learner.params,
                                                           opt_state_like=learner.opt_state)
    learner.version = int(meta["version"])
    prompts.set_state(meta["data_state"])
    _truncate_jsonl(metrics_path, lambda r: r.get("version", 0) <= learner.version)
    _truncate_jsonl(prompts_path, lambda r: r["version"] < learner.version)
    _say(f"resumed from checkpoint at policy version {learner.version}")
  else:
    for path in (metrics_path, prompts_path):
      if os.path.exists(path):
        os.remove(path)

  engine = engine_from_config(config, rollout_mesh, model_config) if rollout_mesh else None
  if engine is not None and config.rollout.warm_up:
    engine.warm_up()  # in the background, during evaluation and warm start
  eval_mesh = rollout_mesh or learner_mesh
  eval_shardings = models.param_shardings(model_config, eval_mesh)
  evaluator = Evaluator.from_config(config, model_config, eval_mesh, tokenizer, eval_problems)
  if latest is None and config.learner.warm_start_steps and not config.model.hf_path:
    eval_params, _ = local_transfer(learner.params, eval_shardings)
    meta["untrained_eval_accuracy"] = primary(evaluator.evaluate(eval_params, reward))
    t = time.time()
    examples = pipeline.read_split(builder, "train")
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    bar = tqdm(total=config.learner.warm_start_steps, desc="warm start (supervised)", unit="step",
               file=sys.stdout, dynamic_ncols=True)
    def progress(step, loss):
      bar.update(step - bar.n)
      bar.set_postfix(loss=f"{loss:.3f}")
    params, loss = warm_start(model_config, learner.params, learner_mesh, examples, tokenizer,
                              steps=config.learner.warm_start_steps,
                              batch_size=config.learner.warm_start_batch,
                              learning_rate=config.learner.warm_start_lr, seed=config.seed,
                              token_budget=config.learner.token_budget, progress=progress,
                              grad_clip=config.learner.grad_clip)
    bar.close()
    learner.params = params  # same shardings; the optimizer state is still the untouched initial one
    meta["warm_start_seconds"] = time.time() - t
    meta["warm_start_loss"] = loss

  eval_params, _ = local_transfer(learner.params, eval_shardings)
  if "initial_eval_accuracy" in meta and "initial_eval_greedy_accuracy" not in meta:
    # a checkpoint written before pass@1 existed: its accuracies were greedy; measure both again
    meta.pop("initial_eval_accuracy")
    meta.pop("last_eval_accuracy", None)
  if "initial_eval_accuracy" not in meta:
    initial = evaluator.evaluate(eval_params, reward)
    meta.update(initial_eval_accuracy=primary(initial), initial_eval_greedy_accuracy=initial["greedy"])
  _say(f"model {models.count_params(learner.params):,} params; held-out accuracy "
       f"{meta['initial_eval_accuracy']:.3f} ({eval_kind(evaluator)}), greedy "
       f"{meta['initial_eval_greedy_accuracy']:.3f} at version {learner.version}")

  # --- rollout and controller
  eta, batch_size, group = config.rl.max_staleness, config.learner.batch_size, config.rl.group_size
  slots_total = config.rollout.num_slots * (len(remote) or 1)
  manager = StalenessManager(batch_size=batch_size, max_staleness=eta,
                             max_concurrent=-(-slots_total // group) * group)
  manager.restore(learner.version)
  backend_box = {}
  controller = Controller(prompts=prompts, tokenizer=tokenizer,
                          submit=lambda *r: backend_box["backend"].submit(*r), manager=manager,
                          reward=reward, batch_size=batch_size, group_size=group,
                          max_new_tokens=config.data.max_completion_len, advantage=config.rl.advantage,
                          scale_by_std=config.rl.scale_by_std,
                          reward_source="exact_answer" if config.data.task == "arithmetic"
                          else "math_verify")
  if remote:
    backend = RemoteRollout(remote, controller.on_trajectory, transfer_host=config.rollout.host)
    transfer = backend.update_weights(learner.params, learner.version)  # servers start with no weights
    _say(f"pushed version {learner.version} to {len(remote)} decode servers in {transfer.seconds:.2f}s")
  else:
    backend = LocalRollout(engine, learner.params, learner.version, controller.on_trajectory,
                           on_weight_update=config.rollout.on_weight_update)
  backend_box["backend"] = backend
  if config.rollout.warm_up:
    t = time.time()
    _say("waiting for the decode servers to compile their prefill shapes (rollout.warm_up)")
    backend.wait_until_warm()
    _say(f"decode servers warm after {time.time() - t:.1f}s")
  backend.start()

  from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  writer = SummaryWriter(os.path.join(workdir, "tb"))
  history = _load_history(metrics_path)
  trained_tokens = sum(h.get("trained_tokens", 0) for h in history)
  max_staleness_seen = max((h.get("max_staleness_seen", 0) for h in history), default=0)
  eval_acc = meta.get("last_eval_accuracy", meta["initial_eval_accuracy"])
  eval_greedy = meta.get("last_eval_greedy_accuracy", meta["initial_eval_greedy_accuracy"])
  bar = tqdm(total=config.steps, initial=learner.version, desc=f"async RL (eta={eta}, {config.rl.loss})",
             unit="step", file=sys.stdout, dynamic_ncols=True)
  # Decode counters count from here (remote decode servers may have been up, idle, for a while).
  decode_base, t_rl = backend.decode_stats(), time.time()
  decode, decode_seconds = DecodeStats(), 0.0  # as of the last version
  rl_tokens_this_run = 0
  train_total = 0.0  # seconds the learner spent updating since RL started
  try:
    controller.pump()
    while learner.version < config.steps:
      if backend.error is not None:
        raise RuntimeError(f"rollout failed: {backend.error!r}")
      batch = controller.next_batch(learner.version, timeout=5.0)
      if batch is None:
        continue
      m = learner.train(batch.sequences)
      train_total += m["learner_seconds"]
      transfer = backend.update_weights(learner.params, learner.version)
      manager.set_version(learner.version)
      controller.pump()
      tokens = int(sum(s.mask.sum() for s in batch.sequences))
      trained_tokens += tokens
      rl_tokens_this_run += tokens
      max_staleness_seen = max(max_staleness_seen, batch.max_staleness_seen)
      decode, decode_seconds = backend.decode_stats().since(decode_base), time.time() - t_rl
      record = dict(
          version=learner.version, time=time.time() - t_start, reward=float(batch.rewards.mean()),
          accuracy=float((batch.rewards == 1.0).mean()), trained_tokens=tokens,
          max_staleness_seen=batch.max_staleness_seen, mean_staleness=batch.mean_staleness,
          failed_rollouts=batch.failed, transfer_seconds=transfer.seconds,
          tokens_per_s=rl_tokens_this_run / max(time.time() - t_rl, 1e-9),
          learner_idle_fraction=learner_lib.idle_fraction(train_total, time.time() - t_rl),
          # cumulative decode counters since RL started, summed over the decode servers
          **decode.as_metrics(),
          **{k: v for k, v in m.items() if k != "version"})
      if learner.version % config.learner.eval_every == 0 or learner.version == config.steps:
        eval_params = (backend.rollout_params if not remote else
                       local_transfer(learner.params, eval_shardings)[0])
        result = evaluator.evaluate(eval_params, reward)
        eval_acc, eval_greedy = primary(result), result["greedy"]
        record.update(eval_accuracy=eval_acc, eval_greedy_accuracy=eval_greedy)
      _append_jsonl(metrics_path, record)
      history.append(record)
      _append_jsonl(prompts_path, {"version": learner.version - 1, "prompts": batch.prompt_indices,
                                   "completion_lengths": [len(t.completion_tokens)
                                                          for t in batch.trajectories]})
      for k, v in record.items():
        if isinstance(v, (int, float)):
          writer.add_scalar(k, v, learner.version)
      bar.update(1)
      bar.set_postfix(reward=f"{record['reward']:.2f}", eval=f"{eval_acc:.2f}", v=learner.version,
                      stale=batch.max_staleness_seen, tok_s=f"{record['tokens_per_s']:.0f}")
      if learner.version % config.checkpoint.every_steps == 0 or learner.version == config.steps:
        meta.update(version=learner.version, data_state=controller.data_state_for(learner.version),
                    staleness=manager.state_dict(), last_eval_accuracy=eval_acc,
                    last_eval_greedy_accuracy=eval_greedy)
        ckpt.save(learner.version, params=learner.params, opt_state=learner.opt_state,
                  meta=_jsonable(meta))
  finally:
    bar.close()
    backend.stop()
    controller.close()
    ckpt.close()
    writer.close()

  wall = time.time() - t_start
  summary = {
      "initial_eval_accuracy": meta["initial_eval_accuracy"],
      "untrained_eval_accuracy": meta.get("untrained_eval_accuracy"),
      "final_eval_accuracy": eval_acc,
      "eval_metric": eval_kind(evaluator),
      "initial_eval_greedy_accuracy": meta["initial_eval_greedy_accuracy"],
      "final_eval_greedy_accuracy": eval_greedy,
      "trained_tokens": trained_tokens,
      "wall_seconds": wall,
      "rl_seconds_this_run": time.time() - t_rl,
      "effective_tokens_per_s": rl_tokens_this_run / max(time.time() - t_rl, 1e-9),
      "max_staleness_seen": max_staleness_seen,
      "max_staleness": eta,
      "loss": config.rl.loss,
      "steps": learner.version,
      "warm_start_seconds": meta.get("warm_start_seconds"),
      "learner_idle_fraction": learner_lib.idle_fraction(train_total, time.time() - t_rl),
      "decode_slot_utilization": decode.slot_utilization(decode_seconds),
      "duplicates_dropped": controller.duplicates,
      "failed_rollouts": controller.failed,
      "devices": {"rollout": dict(rollout_mesh.shape) if rollout_mesh else remote,
                  "learner": dict(learner_mesh.shape)},
  }
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  _plot(history, summary, os.path.join(workdir, "progress.png"))
  _print_summary(summary)
  return summary


def _jsonable(d: dict) -> dict:
  return json.loads(json.dumps(d, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


def _load_history(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(l) for l in f if l.strip()]


def _print_summary(summary: dict) -> None:
  rows = [("held-out accuracy, before RL", summary["initial_eval_accuracy"]),
          ("held-out accuracy, after RL", summary["final_eval_accuracy"]),
          ("  (metric)", summary["eval_metric"]),
          ("held-out greedy accuracy, before RL", summary["initial_eval_greedy_accuracy"]),
          ("held-out greedy accuracy, after RL", summary["final_eval_greedy_accuracy"]),
          ("policy versions trained", summary["steps"]),
          ("trained tokens", summary["trained_tokens"]),
          ("effective tokens/s", summary["effective_tokens_per_s"]),
          ("max staleness seen / allowed", f"{summary['max_staleness_seen']} / {summary['max_staleness']}"),
          ("learner idle fraction", summary["learner_idle_fraction"]),
          ("decode slot utilization", summary["decode_slot_utilization"]),
          ("wall seconds", summary["wall_seconds"])]
  width = max(len(r[0]) for r in rows)
  print("\n" + "-" * (width + 16))
  for name, value in rows:
    value = f"{value:.3f}" if isinstance(value, float) else "n/a" if value is None else str(value)
    print(f"{name:<{width}}  {value:>12}")
  print("-" * (width + 16), flush=True)


def _plot(history, summary, path) -> None:
  if not history:
    return
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(7, 4))
  t = [h["time"] for h in history]
  ax.plot(t, [h["reward"] for h in history], alpha=0.5, label="batch reward (sampled)")
  ev = [h for h in history if "eval_accuracy" in h]
  t_ev = [history[0]["time"]] + [h["time"] for h in ev]
  ax.plot(t_ev, [summary["initial_eval_accuracy"]] + [h["eval_accuracy"] for h in ev], "o-",
          label=f"held-out accuracy ({summary['eval_metric']})")
  if summary["eval_metric"] != "greedy":
    ax.plot(t_ev, [summary["initial_eval_greedy_accuracy"]] +
            [h.get("eval_greedy_accuracy", np.nan) for h in ev], "s--", label="held-out greedy accuracy")
  ax.set_xlabel("seconds")
  ax.set_ylim(0, 1)
  ax.set_title(f"{summary['loss']}, eta={summary['max_staleness']}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


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

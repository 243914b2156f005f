"""The main job: ``python -m asyncrl_jax.train --config=configs/default.py --workdir=DIR``.

setup -> meshes (rollout : learner split of the devices) -> data (TFDS array_record + grain) -> model
and learner (resume from DIR/checkpoints, else ``model.hf_path``, else random init + supervised warm
start) -> decode server (rollout mesh, its own thread) + controller (staleness-bounded admission,
rewards, batches) -> loop: batch -> update -> publish version v+1 -> checkpoint / evaluate -> summary.

Writes ``DIR/metrics.jsonl``, TensorBoard events in ``DIR/tb``, ``DIR/progress.png``,
``DIR/trained_prompts.jsonl`` and ``DIR/summary.json`` (``runlog.RunLog``). Killed at any point, the
same command resumes from the last checkpoint (``checkpoint.RunCheckpointer``).

Over several learner processes (``asyncrl_jax.infra.distributed``: ``ASYNCRL_COORDINATOR`` etc., or nothing
on Cloud TPU), process 0 runs everything above and the others follow its ops
(``learner_group.LearnerGroup``); decode servers are then other processes (``rollout.servers``) that
register with process 0 (``rollout.registry``).
"""

from __future__ import annotations

from asyncrl_jax import cli

cli.ensure_cpu_devices(4)

# pylint: disable=wrong-import-position
import dataclasses
import signal
import sys
import threading
import time
import traceback
from typing import Optional

import jax
from absl import app, flags, logging

from asyncrl_jax import config as config_lib, envs, models
from asyncrl_jax.controller.controller import Controller, SamplingMismatch
from asyncrl_jax.controller.schedule import PublishSchedule
from asyncrl_jax.data import builder as builder_lib, pipeline
from asyncrl_jax.infra import auth, distributed, faults, leave, paths, sharding, progress as progress_lib
from asyncrl_jax.learner.group import LearnerGroup
from asyncrl_jax.learner.learner import NonFiniteError
from asyncrl_jax.rl.evaluation import RunEvaluation, final_size
from asyncrl_jax.rl.health import HealthMonitor, Thresholds
from asyncrl_jax.rl.rewards import reward_fn
from asyncrl_jax.rollout.engine import engine_from_config
from asyncrl_jax.rollout.grpc_service import RolloutClient
from asyncrl_jax.rollout.local import LocalRollout
from asyncrl_jax.rollout.registry import Registry
from asyncrl_jax.rollout.remote import RemoteRollout
from asyncrl_jax.sft.supervised import warm_start
from asyncrl_jax.train import learner_side
from asyncrl_jax.tokenization import tokenizer_of
from asyncrl_jax.train.checkpoint import RunCheckpointer
from asyncrl_jax.train.runlog import RunLog, say

_CONFIG = cli.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and summaries.")


@dataclasses.dataclass
class _Data:
  builder: object
  tokenizer: object
  reward: object
  eval_problems: list
  prompts: pipeline.PromptStream
  workdir: str  # (where the warm start's demonstrations are prepared, when they are apart)

  @classmethod
  def from_config(cls, config, workdir: str) -> "_Data":
    builder = builder_lib.from_config(config, workdir)
    return cls(builder, tokenizer_of(config), reward_fn(config.data.task),
               # (enough for every evaluation and for the final one, which may read more)
               pipeline.read_split(builder, builder_lib.held_out_split(builder),
                                   max(config.data.eval_problems, final_size(config)[0])),
               # the one controller reads every prompt, however many learner processes there are
               pipeline.PromptStream(builder.as_data_source(split="train"), seed=config.seed,
                                     shard_index=0, shard_count=1), workdir)


def _warm_start(config, data: _Data, evaluate: Optional[RunEvaluation]):
  """Process 0's supervised warm start of a randomly initialised policy (``learner_side.set_up``
  calls it with the weights and the mesh to train them on); returns (params, its meta figures)."""

  def run(model_config, params, mesh):
    one = jax.process_count() == 1  # (over several processes it runs on process 0's devices alone)
    meta = {"untrained_eval_accuracy": evaluate(params)[0] if evaluate and one else None}
    t = time.time()
    bar = progress_lib.progress(total=config.learner.warm_start_steps, desc="warm start (supervised)",
                                unit="step")

    def progress(step, loss):
      bar.update(step - bar.n)
      bar.set_postfix(loss=f"{loss:.3f}")

    params, meta["warm_start_loss"] = warm_start(
        model_config, params, mesh,
        pipeline.read_split(builder_lib.demonstrations_from_config(config, data.workdir), "train"),
        data.tokenizer, steps=config.learner.warm_start_steps, batch_size=config.learner.warm_start_batch,
        learning_rate=config.learner.warm_start_lr, seed=config.seed,
        token_budget=config.learner.token_budget, progress=progress, grad_clip=config.learner.grad_clip,
        observation=envs.observation_markers(config),
        adapters_only=config.learner.warm_start_train == "adapters")
    meta["warm_start_train"] = config.learner.warm_start_train
    bar.close()  # the RL optimizer state is still the untouched initial one
    meta["warm_start_seconds"] = time.time() - t
    return params, meta

  return run


def _policy(config, meshes, data: _Data, ckpt: RunCheckpointer, log: RunLog):
  """Process 0's learner side (``learner_side.set_up``: restored from the last checkpoint or
  initialised and warm-started), its engine when the decode server is in this process, and its
  held-out evaluation; returns (learner, group, evaluation or None, engine or None, meta)."""
  model_config = models.config_of(config)
  engine = engine_from_config(config, meshes.rollout, model_config) if meshes.rollout else None
  if engine is not None and config.rollout.warm_up:
    engine.warm_up()  # in the background, during evaluation and warm start
  evaluate = RunEvaluation(config, model_config, meshes, data.tokenizer, problems=data.eval_problems,
                           reward=data.reward) if config.learner.eval_every else None
  side = learner_side.set_up(config, meshes, ckpt, prompts=data.prompts,
                             warm_start=_warm_start(config, data, evaluate),
                             eval_prompt_ids=evaluate.prompt_ids if evaluate else None)
  if side.resumed:
    log.resume(side.learner.version)
    say(f"resumed from checkpoint at policy version {side.learner.version}")
  else:
    log.start_fresh()
  return side.learner, side.group, evaluate, engine, side.meta or {}


def _initial_evaluation(config, group: LearnerGroup, evaluate: Optional[RunEvaluation], meta: dict) -> None:
  """The held-out accuracy RL starts from (every learner process evaluates together), unless the
  checkpoint resumed from holds it."""
  learner = group.learner
  if evaluate is None:
    meta.update(initial_eval_accuracy=None, initial_eval_greedy_accuracy=None)
    say(f"model {models.count_params(learner.params):,} params at version {learner.version}; no "
        "held-out evaluation (learner.eval_every=0)")
    return
  if meta.get("initial_eval_greedy_accuracy") is None:  # (a checkpoint from before pass@1: measure both)
    meta.pop("last_eval_accuracy", None)
    (meta["initial_eval_accuracy"], meta["initial_eval_greedy_accuracy"]), extra = group.evaluate(
        lambda: evaluate.run(learner))
    meta.update({k: v for k, v in extra.items() if k.startswith("initial_final_eval_")})
  say(f"model {models.count_params(learner.params):,} params; held-out accuracy "
      f"{meta['initial_eval_accuracy']:.3f} ({evaluate.kind}), greedy "
      f"{meta['initial_eval_greedy_accuracy']:.3f} at version {learner.version}"
      + (f" (over {group.processes} learner processes)" if group.processes > 1 else "")
      + (f"; on the last version's evaluation {meta['initial_final_eval_accuracy']:.3f}, greedy "
         f"{meta['initial_final_eval_greedy_accuracy']:.3f}" if "initial_final_eval_accuracy" in meta else ""))


def _registered(config, model_config, tokenizer, workdir: str, token, incarnation: int):
  """Starts the registry on process 0 and waits for ``rollout.servers`` decode servers; returns the
  registry's gRPC server and the servers."""
  registry = Registry(model_config, tokenizer.identity, incarnation)
  server, port = registry.serve(config.rollout.host, config.rollout.registry_port, token=token)
  address = f"{config.rollout.host}:{port}"
  paths.write_text(paths.join(workdir, "registry_address"), address)  # atomic: readers poll for it
  say(f"waiting for {config.rollout.servers} decode servers to register at {address}")
  return registry, server, registry.wait_for(config.rollout.servers, config.rollout.register_timeout)


def _rollout(config, meshes, engine, group: LearnerGroup, data: _Data, workdir: str, token):
  """The decode servers' backend, holding the learner's current weights (not started)."""
  learner = group.learner
  if meshes.remote:
    # this start of the learner: decode servers that outlived an earlier one (the run resumed from
    # its checkpoint) drop that one's work when they get these weights, whatever their version
    incarnation = time.time_ns()
    registry, registry_server, servers = _registered(config, models.config_of(config), data.tokenizer,
                                                     workdir, token, incarnation)
    r = config.rollout
    # servers that register later (restarted, perhaps elsewhere) join through the registry
    backend = RemoteRollout(servers, group.publisher, push_timeout=r.push_timeout,
                            deadline=r.server_deadline, heartbeat=min(1.0, r.server_deadline / 4), push_retries=r.push_retries,
                            orphan_timeout=r.register_timeout, registry=registry,
                            client=lambda address: RolloutClient(address, token),
                            incarnation=incarnation, registry_server=registry_server)
    t = time.time()
    backend.update_weights(learner.params, learner.version)  # servers start with no weights
    backend.wait_for_pulls(learner.version)
    say(f"pushed version {learner.version} to {len(servers)} decode servers "
        f"({', '.join(f'{s.server_id} at {s.address}' for s in servers)}) in {time.time() - t:.2f}s")
    return backend
  return LocalRollout(engine, learner.params, learner.version,
                      on_weight_update=config.rollout.on_weight_update,
                      env_workers=config.env.workers or config.rollout.num_slots,
                      env_timeout=config.env.step_timeout)


class _Profile:
  """A jax profiler trace of versions ``[learner.profile_start, + learner.profile_versions)`` in
  ``WORKDIR/profile`` (every thread of the process: decode, learner, host work): an ``.xplane.pb`` for
  TensorBoard's profile plugin and a ``perfetto_trace.json.gz`` for ui.perfetto.dev (README,
  Benchmarks)."""

  def __init__(self, config, workdir: str):
    self.start, self.stop = config.learner.profile_start, config.learner.profile_start + \
        config.learner.profile_versions
    self.path, self.tracing = paths.join(workdir, "profile"), False

  def before(self, version: int) -> None:
    if version == self.start and not self.tracing:
      jax.profiler.start_trace(self.path, create_perfetto_trace=True)  # (+ a file Perfetto opens)
      self.tracing = True

  def after(self, version: int) -> None:
    """``version``: the learner's version after a training step."""
    if self.tracing and version >= self.stop:
      self.close()

  def close(self) -> None:
    if self.tracing:
      jax.profiler.stop_trace()
      self.tracing = False
      say(f"profile of versions {self.start}..{self.stop - 1} written to {self.path}")


def _train(config, group: LearnerGroup, controller, backend, evaluate, log: RunLog, ckpt, meta: dict):
  """The RL loop: one policy version per batch, until ``config.steps``; returns the last accuracies."""
  profile = _Profile(config, log.workdir)
  try:
    return _train_versions(config, group, controller, backend, evaluate, log, ckpt, meta, profile)
  finally:
    profile.close()


def _train_versions(config, group: LearnerGroup, controller, backend, evaluate, log: RunLog, ckpt,
                    meta: dict, profile: _Profile):
  learner = group.learner
  publisher = PublishSchedule(config, backend, controller, learner)
  monitor = HealthMonitor(Thresholds.from_config(config), log.history)  # (replayed on resume)
  if publisher.pinned and learner.version:
    logging.warning("rl.staleness_mode=pinned resumed at version %d: the next %d batches are decoded "
                    "under version %d (staleness below %d); from then on it is pinned again",
                    learner.version, config.rl.max_staleness, learner.version, config.rl.max_staleness)
  accuracy = (meta.get("last_eval_accuracy", meta["initial_eval_accuracy"]),
              meta.get("last_eval_greedy_accuracy", meta["initial_eval_greedy_accuracy"]))
  log.start_rl(learner.version, backend.decode_stats())
  controller.pump()
  waiting_since = time.time()
  while learner.version < config.steps:
    faults.at("sigterm", learner.version)
    if group.should_stop():  # SIGTERM (preemption) in any learner process: save this version, exit
      return _preempted(config, group, controller, ckpt, meta, accuracy)
    if backend.error is not None:
      raise RuntimeError(f"rollout failed: {backend.error!r}")
    if not publisher.behind:  # (pinned, behind: the learner's weights are not the published version's)
      backend.maintain()  # (remote servers: joiners get the current weights, failed pulls retried)
    # admission counts with the decode servers' version, which also moves when a pull lands or a
    # lagging server is dropped: admit whatever that freed, not only on arrivals and new versions
    controller.pump()
    if publisher.behind:  # pinned: publish once the held weights' rollouts are all in, then train
      publisher.publish()
      if publisher.behind:
        controller.wait(timeout=0.2)
      continue
    batch = controller.next_batch(learner.version, timeout=1.0)
    if batch is None:
      if time.time() - waiting_since > 60:  # say what a long wait waits for
        waiting_since = time.time()
        missing = controller.missing(learner.version)  # (admitted ones; the rest wait for room)
        where = backend.locate(missing[:8])
        logging.warning("version %d still waits for %d rollouts: %s", learner.version, len(missing),
                        ", ".join(f"{i} at {w}" for i, w in where.items()))
      continue
    waiting_since = time.time()
    faults.at("train", batch.version)
    if faults.at("nan", batch.version):
      batch.sequences[0].advantages[:] = float("nan")
    profile.before(batch.version)
    update = group.train(batch.sequences, version=batch.version)
    publisher.publish()
    faults.at("push", learner.version)
    controller.pump()
    record = log.version_record(batch, update, publisher.take(), backend.decode_stats(),
                                transfer_seconds=backend.transfer_seconds)
    last = learner.version == config.steps
    if evaluate is not None and (learner.version % config.learner.eval_every == 0 or last):
      rollout_params = publisher.rollout_params()
      accuracy, figures = group.evaluate(lambda: evaluate.run(learner, rollout_params))
      record.update(eval_accuracy=accuracy[0], eval_greedy_accuracy=accuracy[1], **figures)
    alarms = monitor.observe(record)
    for alarm in alarms:
      say(f"ALARM (health monitor): {alarm}")
    log.append(record, batch, alarms=tuple(monitor.active))
    profile.after(learner.version)
    stop = alarms and config.learner.stop_on_alarm
    if learner.version % config.checkpoint.every_steps == 0 or last or stop:
      meta.update(last_eval_accuracy=accuracy[0], last_eval_greedy_accuracy=accuracy[1])
      group.save(ckpt.run_meta(learner, controller, meta))
    if stop:
      say(f"learner.stop_on_alarm: stopped at policy version {learner.version} of {config.steps} with "
          f"a checkpoint ({'; '.join(map(str, alarms))})")
      return _AlarmStop(accuracy, alarms)
  return accuracy


@dataclasses.dataclass
class _AlarmStop:
  """``_train_versions``' outcome when ``learner.stop_on_alarm`` stopped the run."""
  accuracy: tuple
  alarms: list


def _preempted(config, group: LearnerGroup, controller, ckpt, meta: dict, accuracy) -> None:
  """Every learner process saves the current version (unless it is the newest checkpoint already);
  returns None (the caller then stops the decode servers and waits for the write)."""
  learner = group.learner
  if ckpt.latest_step() != learner.version:
    meta.update(last_eval_accuracy=accuracy[0], last_eval_greedy_accuracy=accuracy[1])
    group.save(ckpt.run_meta(learner, controller, meta))
  say(f"SIGTERM: saving policy version {learner.version} of {config.steps} and stopping; the same "
      "command resumes from it")
  return None


def _checkpointer(config, workdir: str) -> RunCheckpointer:
  return RunCheckpointer(paths.join(workdir, "checkpoints"), max_to_keep=config.checkpoint.max_to_keep,
                         async_save=config.checkpoint.async_save)


def _follow(config, workdir: str) -> dict:
  """Learner processes other than 0: the same learner side (``learner_side.set_up``, whose
  collectives come in process 0's order), then process 0's ops."""
  meshes = sharding.role_meshes(config)
  ckpt = _checkpointer(config, workdir)
  side = learner_side.set_up(config, meshes, ckpt)
  learner, group = side.learner, side.group
  if config.learner.eval_every:  # process 0's held-out prompts; only it holds their answers
    evaluate = RunEvaluation(config, learner.model_config, meshes, tokenizer_of(config),
                             prompt_ids=side.eval_prompt_ids)
    group.on_evaluate = lambda: evaluate.run(learner)
  _take_sigterm(group)
  try:
    group.follow()
  except Exception:  # pylint: disable=broad-except
    _abandon()
  ckpt.close()
  return {"preempted_at_version": learner.version} if group.agreed_stop else {}


def _abandon() -> None:
  """A learner process of several failed, or a peer died under a collective: the others cannot
  finish the collective clean-up (stop, checkpoint write), so this one leaves now, exit 1, with the
  error; the newest complete checkpoint stays what the next start resumes from. (A process that does
  not see the failure is stopped by JAX within ``ASYNCRL_HEARTBEAT_SECONDS``.)"""
  traceback.print_exc()
  print(f"error: learner process {jax.process_index()} of {jax.process_count()} stops without "
        "its clean-up (a learner process failed or died); the next start resumes from the newest "
        "complete checkpoint", file=sys.stderr)
  leave.now(1)


_EARLY_SIGTERM = threading.Event()


def _take_sigterm(group: LearnerGroup) -> None:
  """From now on SIGTERM is the group's stop request (one that came during setup counts too)."""
  group.install_sigterm()
  if _EARLY_SIGTERM.is_set():
    group.stop_requested.set()


def run(config, workdir: str) -> dict:
  """The main job in this process: all of it on learner process 0, ``_follow`` on the others."""
  token = auth.load_token(config.rollout.auth_token_file) if config.rollout.servers else None
  if config.rollout.servers:  # (refused before any setup: binding beyond loopback needs a token)
    auth.require(config.rollout.host, token, "rollout.host")
  signal.signal(signal.SIGTERM, lambda *_: _EARLY_SIGTERM.set())  # (until the group takes over)
  signal.siginterrupt(signal.SIGTERM, False)  # native threads' system calls restart, not fail
  if jax.process_index() != 0:
    return _follow(config, workdir)
  sandboxing = envs.sandbox_status(config)  # (refused before any setup where the sandbox cannot run)
  if sandboxing and not sandboxing["sandboxed"]:
    logging.warning("UNSANDBOXED: model-written code runs with resource limits only "
                    "(env.allow_unsandboxed=True; the sandbox cannot run here: %s)", sandboxing["why"])
    say(f"warning: the Python tool runs model code UNSANDBOXED (env.allow_unsandboxed): {sandboxing['why']}")
  meshes = sharding.role_meshes(config)
  data = _Data.from_config(config, workdir)
  log = RunLog(workdir, config, data.tokenizer)
  say(meshes.describe())
  ckpt = _checkpointer(config, workdir)
  learner, group, evaluate, engine, meta = _policy(config, meshes, data, ckpt, log)
  try:
    _initial_evaluation(config, group, evaluate, meta)
  except Exception:  # pylint: disable=broad-except
    if jax.process_count() > 1:  # (the others wait in the evaluation's collectives)
      log.close()
      _abandon()
    raise
  _take_sigterm(group)
  try:
    backend = _rollout(config, meshes, engine, group, data, workdir, token)
  except BaseException:
    group.stop()
    raise
  controller = Controller.from_config(config, prompts=data.prompts, tokenizer=data.tokenizer,
                                      submit=backend.submit, version=lambda: backend.version,
                                      reward=data.reward, num_servers=backend.num_servers,
                                      newest_version=lambda: learner.version)
  if config.rollout.warm_up:
    t = time.time()
    say("waiting for the decode servers to compile their prefill shapes (rollout.warm_up)")
    backend.wait_until_warm()
    say(f"decode servers warm after {time.time() - t:.1f}s")
  backend.start(controller.on_trajectory)
  try:
    final = _train(config, group, controller, backend, evaluate, log, ckpt, meta)
  except Exception:  # pylint: disable=broad-except
    if jax.process_count() > 1:
      log.close()
      _abandon()
    raise
  finally:
    log.close()
    backend.stop()
    group.stop()
    controller.close()
    ckpt.close()  # (waits for the last write)
  if final is None:  # preempted: the checkpoint is written, the summary is the resumed run's
    return {"preempted_at_version": learner.version}
  alarms, report = [], backend.report()
  if isinstance(final, _AlarmStop):
    final, alarms = final.accuracy, [str(a) for a in final.alarms]
  summary = log.summary(
      meta, final_eval_accuracy=final[0], final_eval_greedy_accuracy=final[1],
      eval_metric=evaluate.kind if evaluate else None, steps=learner.version,
      **(evaluate.final_figures() if evaluate else {}),
      duplicates_dropped=controller.duplicates, failed_rollouts=controller.failed,
      prompts_skipped_too_long=controller.skipped_prompts,
      rejected_rollouts=dict(controller.rejected), retried_rollouts=controller.retried,
      reward_timeouts=getattr(data.reward, "timeouts", 0),  # (math-verify: scored 0, counted)
      reward_failures=getattr(data.reward, "failures", 0),
      decode_server_faults=report.faults, decode_server_events=report.events,
      learner_processes=jax.process_count(), decode_servers=backend.num_servers,
      stopped_on_alarm=alarms, python_tool_sandbox=sandboxing, decode_server_sandboxes=report.sandboxes,
      transfer_bytes_sent=report.bytes_by_source, weight_publishes=report.publishes,
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
    try:
      faults.planned()  # a malformed ASYNCRL_FAULT is refused before anything starts
      multi = distributed.initialize()
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    cli.use_compile_cache(_WORKDIR.value)
    try:
      result = run(config, _WORKDIR.value)
    except (config_lib.ConfigError, auth.AuthError, envs.SandboxUnavailable) as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    except (NonFiniteError, SamplingMismatch) as e:  # a clear stop: the message says what and where
      print(f"error: {e}", file=sys.stderr)
      result = {"error": str(e)}
    code = 1 if "error" in result else 0
    if result.get("stopped_on_alarm"):  # (process 0's summary; the others return {})
      print(f"error: the health monitor stopped the run (learner.stop_on_alarm): "
            f"{'; '.join(result['stopped_on_alarm'])}; the checkpoint of version {result['steps']} is "
            "written. The same command resumes from it (the standing alarm does not stop it again, a new "
            "one does); raise the monitor.* threshold or set learner.stop_on_alarm=False to go on "
            "regardless",
            file=sys.stderr)
      code = 1
    # Everything is written and closed (the checkpoint waited for its write, the summary is on disk,
    # the decode servers and their environments are stopped). Leave without interpreter shutdown:
    # there a native thread (XLA's, gRPC's, a tokenizer's) still running can abort the process
    # ("terminate called ... exception not rethrown", seen in CI after a run had finished), and a
    # preemption notice's seconds are not spent on it.
    if multi:
      jax.distributed.shutdown()
    leave.now(code)  # (kills the reward pool's workers, which would hold stdout open)

  app.run(_main, argv=argv, flags_parser=cli.parse_flags)


if __name__ == "__main__":
  main()

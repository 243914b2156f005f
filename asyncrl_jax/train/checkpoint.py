"""Orbax checkpoints of the whole run: params, optimizer state (the value model's too, with value
advantages), policy version, staleness counters, prompt-stream (grain) state. Saves are asynchronous and atomic (a save interrupted by SIGKILL leaves
no half-written step behind); ``RunCheckpointer.restore_run`` resumes from the newest complete step.
The directory may be a bucket (``gs://bucket/run/checkpoints``), which every learner host writes."""

from __future__ import annotations

import json
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from asyncrl_jax.infra import faults

from asyncrl_jax.infra import paths


class Checkpointer:
  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
    paths.require_backend(directory)  # before Orbax fails on it with a less telling ImportError
    self.directory = paths.absolute(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                           enable_async_checkpointing=async_save, create=True)
    self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

  def save(self, step: int, *, state: dict, meta: dict) -> None:
    """Starts saving ``step``: ``state`` (name -> pytree of arrays, e.g. ``Learner.checkpoint_state``)
    and the JSON ``meta``; returns before the write finishes when async."""
    self._mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                 meta=ocp.args.JsonSave(meta)))
    faults.at("save", step)  # (tests: SIGKILL while the write is under way)

  def latest_step(self) -> Optional[int]:
    return self._mgr.latest_step()

  def restore(self, step: int, *, state_like: dict) -> tuple[dict, dict]:
    """Restores ``step`` onto the shapes and shardings of ``state_like`` (arrays or specs, named as
    saved); returns (state, meta). A name the checkpoint lacks is an error that names it."""
    saved = self._mgr.item_metadata(step)
    saved = saved.get("state") if saved is not None and hasattr(saved, "get") else None
    if saved is not None and set(saved) != set(state_like):
      raise ValueError(f"checkpoint step {step} in {self.directory} holds {', '.join(sorted(saved))}, "
                       f"but this run restores {', '.join(sorted(state_like))}: it was written by a "
                       "run with other settings (rl.advantage='value' adds the value model)")
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        state_like)
    out = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                          meta=ocp.args.JsonRestore()))
    return dict(out.state), dict(out.meta)

  def wait(self) -> None:
    self._mgr.wait_until_finished()

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()


def _jsonable(d: dict) -> dict:
  return json.loads(json.dumps(d, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


class RunCheckpointer(Checkpointer):
  """The whole run state, one call each way: the learner's params, optimizer state and version, the
  prompt stream's position at that version's batch, the staleness counters and the run's meta
  (evaluations, warm-start figures)."""

  @staticmethod
  def run_meta(learner, controller, meta: dict) -> dict:
    """``meta`` updated with the version, data and staleness state to save at ``learner.version``."""
    meta.update(version=learner.version, data_state=controller.data_state_for(learner.version),
                staleness=controller.manager.state_dict())
    return _jsonable(meta)

  def restore_run(self, learner, prompts) -> Optional[dict]:
    """Restores the newest complete step into ``learner`` and ``prompts`` (None in learner processes
    that read no data); returns its meta, or None when there is no checkpoint (a fresh run). The
    staleness counters restart from the restored version (``StalenessManager.restore``): what was in
    flight at save time is gone."""
    step = self.latest_step()
    if step is None:
      return None
    state, meta = self.restore(step, state_like=learner.checkpoint_state())
    learner.load_checkpoint_state(state)
    learner.version = int(meta["version"])
    if prompts is not None:
      prompts.set_state(meta["data_state"])
    return meta

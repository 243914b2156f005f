"""Orbax checkpoints of the whole run: params, optimizer state (the value model's too, with value
advantages), policy version, staleness counters, prompt-stream (grain) state. Saves are asynchronous and atomic (a save interrupted by SIGKILL leaves
no half-written step behind); ``RunCheckpointer.restore_run`` resumes from the newest complete step.
The directory may be a bucket (``gs://bucket/run/checkpoints``), which every learner host writes.

With LoRA a step holds the adapters and their optimizer state alone, and its meta names the frozen
base (``base``: where it came from and ``lora.fingerprint`` of it). A base loaded from
``model.hf_path`` is loaded from there again on resume; one that came from no checkpoint (the warm
start's) is written once, to ``DIR/base`` (an Orbax checkpoint, complete when ``DIR/base.json``
exists). A resume whose base does not match the fingerprint stops with an error that says so.

With ``rl.kl_coef`` the KL penalty's reference (the policy RL started from: its weights, or its LoRA
adapters) is written once at the start, to ``DIR/reference`` (complete when ``DIR/reference.json``
exists), and read back on resume."""

from __future__ import annotations

import json
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from asyncrl_jax.infra import faults, paths
from asyncrl_jax.models import lora

BASE_DIR = "base"  # (under the checkpoint directory) a LoRA run's frozen base, when it came from no checkpoint
REFERENCE_DIR = "reference"  # (under the checkpoint directory) the KL penalty's reference (rl.kl_coef)


class Checkpointer:
  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
    paths.require_backend(directory)  # before Orbax fails on it with a less telling ImportError
    self.directory = paths.absolute(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                           enable_async_checkpointing=async_save, create=True)
    # (the handlers named, so that item_metadata can read a step's tree before restoring it)
    self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers={
        "state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

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
    if saved is not None and "params" in saved and "adapters" in state_like:
      raise ValueError(f"checkpoint step {step} in {self.directory} holds the whole policy, but this LoRA "
                       "run's steps hold the adapters alone: it was written by a run without LoRA, or "
                       "by a LoRA run before checkpoints held adapters alone (export it with that "
                       "version, or start a new run from its weights with model.hf_path)")
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

  base: Optional[dict] = None  # LoRA: the record naming the frozen base (``keep_base``)

  def run_meta(self, learner, controller, meta: dict) -> dict:
    """``meta`` updated with the version, data and staleness state to save at ``learner.version``
    (and, with LoRA, the base the adapters go on)."""
    meta.update(version=learner.version, data_state=controller.data_state_for(learner.version),
                staleness=controller.manager.state_dict())
    if self.base is not None:
      meta["base"] = self.base
    return _jsonable(meta)

  def keep_base(self, learner, source: str) -> None:
    """LoRA, a fresh run (every learner process): names the learner's frozen base in every later
    step's meta; ``source`` is where it was loaded from (``model.hf_path``), or "" for a base from no
    checkpoint, which is then written to ``DIR/base`` (once: a base already there with the same
    fingerprint is kept). Without LoRA nothing happens."""
    if not learner.model_config.lora:
      return
    base = learner.base_params()
    record = dict(source=source or "warm start", fingerprint=lora.fingerprint(base))
    if not source:
      path, marker = paths.join(self.directory, BASE_DIR), paths.join(self.directory, BASE_DIR + ".json")
      kept = json.loads(paths.read_text(marker))["fingerprint"] if paths.exists(marker) else None
      if kept is None or lora.base_mismatch(kept, record["fingerprint"]):
        if jax.process_index() == 0:
          if paths.exists(marker):
            paths.remove(marker)
          paths.remove_tree(path)
        saver = ocp.StandardCheckpointer()
        saver.save(path, base)
        saver.wait_until_finished()
        saver.close()
        if jax.process_index() == 0:
          paths.write_text(marker, json.dumps(dict(fingerprint=record["fingerprint"])))
      record["path"] = BASE_DIR
    self.base = record

  def keep_reference(self, learner) -> None:
    """rl.kl_coef, a fresh run (every learner process): writes the learner's KL reference to
    ``DIR/reference`` (replacing one a run that made no step left there). Without it nothing
    happens."""
    if learner.reference is None:
      return
    path, marker = (paths.join(self.directory, REFERENCE_DIR),
                    paths.join(self.directory, REFERENCE_DIR + ".json"))
    if jax.process_index() == 0:
      if paths.exists(marker):
        paths.remove(marker)
      paths.remove_tree(path)
    saver = ocp.StandardCheckpointer()
    saver.save(path, learner.reference)
    saver.wait_until_finished()
    saver.close()
    if jax.process_index() == 0:
      paths.write_text(marker, json.dumps(dict(adapters=bool(learner.model_config.lora))))

  def _restore_reference(self, learner, step: int) -> None:
    path = paths.join(self.directory, REFERENCE_DIR)
    if not paths.exists(path + ".json"):
      raise ValueError(f"rl.kl_coef > 0, but checkpoint step {step} in {self.directory} has no KL reference "
                       f"({path} is missing or was not completely written): the run that wrote it had no "
                       "KL term. Resume it with rl.kl_coef=0, or start a new run from its weights")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            learner.reference)
    restorer = ocp.StandardCheckpointer()
    learner.reference = restorer.restore(path, abstract)
    restorer.close()

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
    if learner.model_config.lora:
      self._restore_base(learner, step, meta)
    if learner.reference is not None:
      self._restore_reference(learner, step)
    learner.version = int(meta["version"])
    if prompts is not None:
      prompts.set_state(meta["data_state"])
    return meta

  def _restore_base(self, learner, step: int, meta: dict) -> None:
    """The base the restored adapters were trained on: read from ``DIR/base`` when the run wrote it,
    else the one the learner loaded; either way it must match the step's fingerprint."""
    record = meta.get("base")
    if record is None:
      raise ValueError(f"checkpoint step {step} in {self.directory} holds LoRA adapters but names no "
                       "base weights: it was written before checkpoints named their base")
    if record.get("path"):
      path = paths.join(self.directory, record["path"])
      if not paths.exists(path + ".json"):
        raise ValueError(f"checkpoint step {step} needs the base weights in {path}, which are missing "
                         "or were not completely written")
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                              learner.base_params())
      restorer = ocp.StandardCheckpointer()
      base = restorer.restore(path, abstract)
      restorer.close()
      learner.params = lora.join_nested(lora.split_nested(learner.params)[0], base)
    why = lora.base_mismatch(record["fingerprint"], lora.fingerprint(learner.base_params()))
    if why:
      raise ValueError(f"checkpoint step {step} in {self.directory} holds LoRA adapters trained on the "
                       f"base from {record['source']}, but this run's base weights differ ({why}): "
                       "resume with the model.hf_path the run started from")
    self.base = record

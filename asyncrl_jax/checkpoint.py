"""Orbax checkpoints of the whole run: params, optimizer state, policy version, staleness counters,
prompt-stream (grain) state. Saves are asynchronous and atomic (a save interrupted by SIGKILL leaves
no half-written step behind); ``restore_latest`` resumes from the newest complete step."""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                           enable_async_checkpointing=async_save, create=True)
    self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

  def save(self, step: int, *, params, opt_state, meta: dict) -> None:
    """Starts saving ``step`` (returns before the write finishes when async)."""
    self._mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
        meta=ocp.args.JsonSave(meta)))

  def latest_step(self) -> Optional[int]:
    return self._mgr.latest_step()

  def restore(self, step: int, *, params_like, opt_state_like) -> tuple[Any, Any, dict]:
    """Restores ``step`` onto the shardings of ``params_like`` / ``opt_state_like`` (arrays or specs)."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        {"params": params_like, "opt_state": opt_state_like})
    out = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                          meta=ocp.args.JsonRestore()))
    return out.state["params"], out.state["opt_state"], dict(out.meta)

  def wait(self) -> None:
    self._mgr.wait_until_finished()

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()

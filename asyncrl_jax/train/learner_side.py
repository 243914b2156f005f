"""The learner side of the main job, set up by one function on every learner process, so that the
steps that are collectives come in one order, written once:

1. the model's initial weights on the learner mesh, and the ``Learner``;
2. the checkpoint's restore (the newest complete step, if any);
3. on a fresh start that warm-starts (``learner.warm_start_steps``, no ``model.hf_path``): process 0
   runs the supervised warm start; over several learner processes it runs on process 0's own
   devices (from the same initial weights) and the weights are broadcast to the others;
4. the ``LearnerGroup`` (and, with remote decode servers, the weight publisher and its senders);
5. process 0's held-out prompt ids shared with the others (when evaluation is on);
6. the learner's warm-up compiles (``learner.warm_up``).
"""

from __future__ import annotations

import time
import dataclasses
from typing import Callable, Optional, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from asyncrl_jax import models
from asyncrl_jax.infra import sharding
from asyncrl_jax.learner.group import LearnerGroup
from asyncrl_jax.learner.learner import Learner
from asyncrl_jax.train.runlog import say


@dataclasses.dataclass
class LearnerSide:
  learner: Learner
  group: LearnerGroup
  meta: Optional[dict]  # the restored run's, or (process 0) the warm start's figures; else None
  resumed: bool  # from a checkpoint
  eval_prompt_ids: Optional[list]  # process 0's held-out prompt ids, in every process (evaluation on)


def warm_starts(config) -> bool:
  """Whether a fresh start of this config runs the supervised warm start."""
  return bool(config.learner.warm_start_steps) and not config.model.hf_path


def set_up(config, meshes, ckpt, *, prompts=None,
           warm_start: Optional[Callable[[object, object, object], tuple]] = None,
           eval_prompt_ids: Optional[Sequence] = None) -> LearnerSide:
  """Steps 1-6 on this process.

  Process 0 passes the prompt stream (``prompts``, restored with the checkpoint), ``warm_start(
  model_config, params, mesh) -> (params, meta)`` and its held-out prompt ids; the others pass
  None."""
  model_config, params = models.from_config(config, meshes.learner)
  learner = Learner(model_config, params, meshes.learner, config, versions=config.steps)
  del params
  meta = ckpt.restore_run(learner, prompts)
  resumed = meta is not None
  if not resumed and warm_starts(config):
    meta = _warm_start(config, learner, warm_start)
  if not resumed:  # LoRA: every checkpoint names the frozen base (written once if it is the warm start's)
    ckpt.keep_base(learner, config.model.hf_path)
    if learner.reference is not None:  # rl.kl_coef: the policy RL starts from, after any warm start
      learner.set_reference()
      ckpt.keep_reference(learner)
  group = LearnerGroup(learner, ckpt, transfer_host=config.rollout.host if meshes.remote else None)
  if config.learner.eval_every:
    eval_prompt_ids = group.share_token_lists(eval_prompt_ids if group.is_leader else None)
  if config.learner.warm_up:
    t = time.time()
    n = learner.warm_up(config.data.max_prompt_len + config.data.max_completion_len)
    if group.is_leader:
      say(f"learner warm: {n} micro-batch shapes compiled in {time.time() - t:.1f}s (learner.warm_up)")
  return LearnerSide(learner, group, meta, resumed, eval_prompt_ids)


def _warm_start(config, learner: Learner, warm_start) -> Optional[dict]:
  """Step 3. One process: in place, on the learner mesh. Several: process 0 warm-starts a copy on its
  own devices, every process takes the result from a broadcast."""
  if jax.process_count() == 1:
    learner.params, meta = warm_start(learner.model_config, learner.params, learner.mesh)
  else:
    like = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), models.abstract_params(learner.model_config))
    meta = None
    if jax.process_index() == 0:
      local = sharding.make_mesh(jax.local_devices(), dict(data=1, fsdp=-1, tensor=1))
      _, params = models.from_config(config, local)  # the seed's initial weights, on this host alone
      params, meta = warm_start(learner.model_config, params, local)
      like = jax.device_get(params)
    host = multihost_utils.broadcast_one_to_all(like)
    shardings = jax.tree.map(lambda x: x.sharding, learner.params)
    learner.params = jax.tree.map(
        lambda h, s: jax.make_array_from_callback(h.shape, s, lambda index, h=h: np.asarray(h)[index]),
        host, shardings)
  if learner.critic is not None:  # the value model starts from the policy RL starts from
    learner.critic.reset(learner.params)
  return meta

"""LoRA checkpoints: a step holds the adapters and their optimizer state alone and names the frozen
base by a fingerprint; a base that came from no checkpoint is written once beside the steps. A resume
restores the exact run (base from the written copy), and one onto other base weights is refused."""

import jax
import numpy as np
import pytest
from flax import traverse_util

from asyncrl_jax import config as config_lib, models
from asyncrl_jax.infra import sharding
from asyncrl_jax.learner.learner import Learner
from asyncrl_jax.models import lora
from asyncrl_jax.train.checkpoint import RunCheckpointer
from tests.fixtures.helpers import random_sequences


def _config():
  config = config_lib.base_config()
  config.model.lora.rank = 4
  return config


def _learner(config, seed, mesh):
  model_config = models.config_of(config)
  return Learner(model_config, models.init_params(model_config, jax.random.key(seed), mesh=mesh), mesh,
                 config, versions=10)


def test_the_fingerprint_names_weights_not_their_sharding():
  config = _config()
  model_config = models.config_of(config)
  base = lora.base_model(model_config, models.init_params(model_config, jax.random.key(0)))[1]
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  sharded = jax.device_put(base, models.param_shardings(models.config_of(config_lib.base_config()), mesh))
  want = lora.fingerprint(base)
  assert lora.base_mismatch(want, lora.fingerprint(sharded)) == ""
  other = lora.base_model(model_config, models.init_params(model_config, jax.random.key(1)))[1]
  assert "sum" in lora.base_mismatch(want, lora.fingerprint(other))
  flat = traverse_util.flatten_dict(base)
  key = ("layer_0", "mlp", "up")
  swapped = np.asarray(flat[key]).copy()
  swapped[[0, 1]] = swapped[[1, 0]]  # the same values, two rows exchanged: only the weighted sum sees it
  why = lora.base_mismatch(want, lora.fingerprint(traverse_util.unflatten_dict({**flat, key: swapped})))
  assert why.startswith("layer_0/mlp/up: its weighted sum")


def test_a_lora_step_holds_the_adapters_and_resumes_onto_its_written_base(tmp_path):
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  config = _config()
  learner = _learner(config, 0, mesh)
  learner.train(random_sequences(0, 8, learner.model_config.vocab_size), version=0)
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.keep_base(learner, "")
  assert (tmp_path / "ckpt" / "base.json").exists() and ckpt.base["path"] == "base"
  state = learner.checkpoint_state()
  assert set(state) == {"adapters", "opt_state"}
  assert {k[-1] for k in traverse_util.flatten_dict(state["adapters"])} == {
      f"{t}_lora_{x}" for t in learner.model_config.lora_targets for x in "ab"}
  ckpt.save(1, state=state, meta={"version": 1, "base": ckpt.base, "data_state": None})
  ckpt.close()
  saved = jax.device_get(learner.params)

  # a learner of another seed (another base and adapters): the resume makes it the saved one exactly
  other = _learner(config, 7, mesh)
  restored = RunCheckpointer(str(tmp_path / "ckpt"), async_save=False)
  assert restored.restore_run(other, None)["version"] == 1 and other.version == 1
  for k, v in traverse_util.flatten_dict(saved).items():
    np.testing.assert_array_equal(np.asarray(traverse_util.flatten_dict(jax.device_get(other.params))[k]), v)
  assert restored.base == ckpt.base
  restored.close()

  # a base named by model.hf_path (no written copy): other weights there are refused, by name
  third = RunCheckpointer(str(tmp_path / "ckpt2"), async_save=False)
  third.keep_base(learner, "/models/base")
  assert "path" not in third.base and not (tmp_path / "ckpt2" / "base.json").exists()
  third.save(1, state=learner.checkpoint_state(), meta={"version": 1, "base": third.base, "data_state": None})
  third.close()
  with pytest.raises(ValueError, match=r"trained on the base from /models/base, but this run's base weights differ"):
    RunCheckpointer(str(tmp_path / "ckpt2"), async_save=False).restore_run(_learner(config, 7, mesh), None)
  same = _learner(config, 0, mesh)  # the same base (seed 0): restores
  assert RunCheckpointer(str(tmp_path / "ckpt2"), async_save=False).restore_run(same, None)["version"] == 1


def test_a_step_of_the_whole_policy_is_refused_by_a_lora_run_with_the_reason(tmp_path):
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  learner = _learner(_config(), 0, mesh)
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(1, state={"params": learner.params, "opt_state": learner.opt_state},
            meta={"version": 1, "data_state": None})  # (as LoRA steps were written before)
  ckpt.close()
  with pytest.raises(ValueError, match="holds the whole policy, but this LoRA run's steps hold the adapters alone"):
    RunCheckpointer(str(tmp_path / "ckpt"), async_save=False).restore_run(_learner(_config(), 0, mesh), None)

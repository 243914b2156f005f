"""rl.kl_coef's reference (the policy RL started from) is written once beside the checkpoints and
read back on resume, exactly, for full weights and for LoRA adapters; a resume that needs one the
run never wrote is refused with the reason."""

import jax
import numpy as np
import pytest
from flax import traverse_util

from asyncrl_jax import config as config_lib, models
from asyncrl_jax.infra import sharding
from asyncrl_jax.learner.learner import Learner
from asyncrl_jax.train.checkpoint import RunCheckpointer
from tests.fixtures.helpers import random_sequences


def _learner(seed, mesh, *, kl=0.1, rank=0):
  config = config_lib.base_config()
  config.rl.kl_coef = kl
  config.model.lora.rank = rank
  model_config = models.config_of(config)
  return Learner(model_config, models.init_params(model_config, jax.random.key(seed), mesh=mesh), mesh,
                 config, versions=10)


def _flat(tree):
  return traverse_util.flatten_dict(jax.device_get(tree))


@pytest.mark.parametrize("rank", [0, 4])
def test_the_reference_is_written_at_the_start_and_restored_exactly(tmp_path, rank):
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  learner = _learner(0, mesh, rank=rank)
  start = _flat(learner.reference)
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.keep_base(learner, "")
  ckpt.keep_reference(learner)
  assert (tmp_path / "ckpt" / "reference.json").exists()
  learner.train(random_sequences(0, 8, learner.model_config.vocab_size), version=0)
  trained = _flat(learner.checkpoint_state()["adapters" if rank else "params"])
  assert any(np.any(v != start[k]) for k, v in trained.items())  # (the policy moved from it)
  ckpt.save(1, state=learner.checkpoint_state(), meta={"version": 1, "base": ckpt.base, "data_state": None})
  ckpt.close()

  other = _learner(7, mesh, rank=rank)  # another seed: another start
  assert any(np.any(v != start[k]) for k, v in _flat(other.reference).items())
  assert RunCheckpointer(str(tmp_path / "ckpt"), async_save=False).restore_run(other, None)["version"] == 1
  for k, v in _flat(other.reference).items():
    np.testing.assert_array_equal(v, start[k])
  assert set(_flat(other.reference)) == set(start)


def test_a_resume_that_needs_a_reference_the_run_never_wrote_is_refused(tmp_path):
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  plain = _learner(0, mesh, kl=0.0)
  assert plain.reference is None
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.keep_reference(plain)  # (nothing to write)
  assert not (tmp_path / "ckpt" / "reference.json").exists()
  ckpt.save(1, state=plain.checkpoint_state(), meta={"version": 1, "data_state": None})
  ckpt.close()
  with pytest.raises(ValueError, match=r"rl.kl_coef > 0, but checkpoint step 1 .* has no KL reference"):
    RunCheckpointer(str(tmp_path / "ckpt"), async_save=False).restore_run(_learner(0, mesh), None)

"""Both rollout backends implement ``RolloutBackend`` in full (the main loop probes nothing), and the
fake publisher the backend tests use has the ``weights.Publisher`` interface the learner's
``WeightPublisher`` implements."""

import types

import jax
import numpy as np
import pytest

from tests.fixtures.fakes import FakeBackend, FakePublisher
from tests.rollout.test_remote import FakeClient
from asyncrl_jax import models
from asyncrl_jax.infra import sharding
from asyncrl_jax.learner.publisher import WeightPublisher
from asyncrl_jax.rollout import Engine
from asyncrl_jax.rollout.backend import BackendReport, RolloutBackend
from asyncrl_jax.rollout.local import LocalRollout
from asyncrl_jax.rollout.remote import RemoteRollout
from asyncrl_jax.weights import Publisher

CFG = models.ModelConfig(vocab_size=17, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, max_seq_len=32)


def _members(protocol) -> set:
  return {n for n in vars(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))


def missing_members(obj, members) -> list:
  return sorted(m for m in members if not hasattr(obj, m))


def _backends():
  mesh = sharding.make_mesh(jax.devices()[:1], dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(CFG, mesh=mesh, num_slots=2, max_prefill_length=8, max_target_length=16,
                  background_compile=False)
  local = LocalRollout(engine, engine.load_params(), 0)
  remote = RemoteRollout(["a"], FakePublisher(), client=lambda address: FakeClient(address))
  return local, remote


def test_both_backends_have_every_member_of_the_interface():
  members = _members(RolloutBackend)
  assert {"submit", "update_weights", "report", "maintain", "locate", "version", "error"} <= members
  for backend in _backends():
    try:
      missing = missing_members(backend, members)
      assert not missing, f"{type(backend).__name__} lacks {missing}"
      assert isinstance(backend, RolloutBackend)
      assert isinstance(backend.report(), BackendReport)
    finally:
      backend.stop()
  assert isinstance(FakeBackend(), RolloutBackend) and not missing_members(FakeBackend(), members)
  # negative control: an object without ``report`` is not a backend
  partial = types.SimpleNamespace(**{m: None for m in members - {"report"}})
  assert not isinstance(partial, RolloutBackend)


def test_the_publisher_interface_is_what_the_learner_side_and_the_fake_implement():
  members = _members(Publisher)
  assert members == {"processes", "base_id", "offer", "sources"}
  mesh = sharding.make_mesh(jax.devices()[:1], dict(data=1, fsdp=-1, tensor=1))
  learner = types.SimpleNamespace(model_config=CFG, params=models.init_params(CFG, jax.random.key(0),
                                                                              mesh=mesh))
  offered = []
  real = WeightPublisher(learner, "127.0.0.1", processes=1, gather=lambda address: [address],
                         offer_op=lambda version, uuids, partial: offered.append((version, list(uuids), partial)))
  for publisher in (real, FakePublisher()):
    assert not missing_members(publisher, members), type(publisher).__name__
    assert publisher.processes == 1 and callable(publisher.offer) and callable(publisher.sources)
  (source,) = real.sources(7)
  assert source.uuid == 7 and source.address == real.sender.address and source.blocks
  real.offer(3, [7])
  assert offered == [(3, [7], [False])]
  assert real.base_id == 0 and not real.partial_plan  # (no LoRA: nothing is frozen)
  with pytest.raises(ValueError, match="partial .* needs a LoRA model"):
    real.offer(4, [8], [True])


def test_the_local_backend_moves_the_adapters_alone_over_its_own_copy_of_the_base():
  """LoRA in one process: after the first copy only the adapters move (their bytes alone); the
  server's base is its own copy, so an altered learner base (the control) does not reach it."""
  from flax import traverse_util
  from asyncrl_jax.models import lora
  cfg = CFG.replace(lora_rank=2, lora_alpha=4.0)
  mesh = sharding.make_mesh(jax.devices()[:1], dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(cfg, mesh=mesh, num_slots=2, max_prefill_length=8, max_target_length=16,
                  background_compile=False)
  params = models.init_params(cfg, jax.random.key(0))
  local = LocalRollout(engine, params, 0)
  first_base = {k: np.asarray(v) for k, v in lora.split(local.rollout_params)[1].items()}
  changed = traverse_util.unflatten_dict({k: v + 1.0 for k, v in traverse_util.flatten_dict(params).items()})
  stats = local.update_weights(changed, 1)
  adapters, base = lora.split(local.rollout_params)
  assert stats.bytes == sum(x.nbytes for x in adapters.values()) < 0.1 * models.count_params(params) * 4
  for k, v in adapters.items():
    np.testing.assert_array_equal(np.asarray(v), np.asarray(traverse_util.flatten_dict(changed)[k]))
  for k, v in base.items():
    np.testing.assert_array_equal(np.asarray(v), first_base[k])

"""Decode-server registration with the learner: accepted, replaced on re-registration, and refused
with every differing field named."""

import dataclasses
import threading

import pytest

from asyncrl_jax import models
from asyncrl_jax.rollout import registry

CFG = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=64)


@pytest.fixture
def learner():
  reg = registry.Registry(CFG, "builtin-arithmetic-v1")
  server, port = reg.serve("127.0.0.1", 0)
  yield reg, f"127.0.0.1:{port}"
  server.stop(grace=0)


def _register(address, server_id="decode-0", at="127.0.0.1:5001", model=CFG, tokenizer="builtin-arithmetic-v1",
              incarnation=0):
  return registry.register(address, server_id=server_id, address=at, model_config=model,
                           tokenizer_id=tokenizer, devices=2, mesh={"tensor": 2}, timeout=30,
                           learner_incarnation=incarnation).registered


def test_servers_register_and_a_restarted_one_replaces_its_entry(learner):
  reg, address = learner
  waiter = threading.Thread(target=lambda: reg.wait_for(2, timeout=30))
  waiter.start()
  assert _register(address) == 1
  assert _register(address, "decode-1", "127.0.0.1:5002") == 2
  waiter.join(30)
  assert not waiter.is_alive()
  assert _register(address, "decode-0", "127.0.0.1:6001") == 2  # restarted elsewhere: same id
  got = {s.server_id: (s.address, s.devices, s.mesh) for s in reg.servers()}
  assert got == {"decode-0": ("127.0.0.1:6001", 2, {"tensor": 2}), "decode-1": ("127.0.0.1:5002", 2, {"tensor": 2})}


def test_repeats_to_the_same_learner_change_nothing_and_a_new_learner_or_a_forgotten_server_is_new():
  reg = registry.Registry(CFG, "builtin-arithmetic-v1", incarnation=7)
  server, port = reg.serve("127.0.0.1", 0)
  address = f"127.0.0.1:{port}"
  try:
    reply = registry.register(address, server_id="decode-0", address="127.0.0.1:5001", model_config=CFG,
                              tokenizer_id="builtin-arithmetic-v1", devices=1, timeout=30)
    assert (reply.registered, reply.incarnation) == (1, 7)
    first = reg.servers()[0].registered_at
    assert _register(address, incarnation=7) == 1  # the periodic repeat: the same entry
    assert reg.servers()[0].registered_at == first
    assert _register(address, incarnation=6) == 1  # registered with an earlier learner: new here
    second = reg.servers()[0].registered_at
    assert second > first
    reg.forget("decode-0", "127.0.0.1:9999")  # not its address: kept
    assert [s.registered_at for s in reg.servers()] == [second]
    reg.forget("decode-0", "127.0.0.1:5001")
    assert reg.servers() == []
    assert _register(address, incarnation=7) == 1  # a woken server's repeat after it was dropped
    assert reg.servers()[0].registered_at > second
  finally:
    server.stop(grace=0)


def test_a_model_or_tokenizer_mismatch_is_refused_naming_both_values(learner):
  reg, address = learner
  with pytest.raises(registry.RegistrationRefused,
                     match=r"num_layers=3 \(server\) vs 2 \(learner\); vocab_size=18 \(server\) vs 17"):
    _register(address, model=dataclasses.replace(CFG, num_layers=3, vocab_size=18))
  with pytest.raises(registry.RegistrationRefused,
                     match=r"tokenizer 'hf:other:ab12' \(server\) vs 'builtin-arithmetic-v1' \(learner\)"):
    _register(address, tokenizer="hf:other:ab12")
  assert reg.servers() == []


def test_waiting_for_servers_that_never_come_names_who_did(learner):
  reg, address = learner
  _register(address)
  with pytest.raises(TimeoutError, match=r"1 of 2 decode servers registered within 1s \(decode-0 at 127.0.0.1:5001\)"):
    reg.wait_for(2, timeout=1)


def test_no_learner_at_the_address_times_out_clearly():
  with pytest.raises(TimeoutError, match="no learner registry at 127.0.0.1:9 within 1s"):
    registry.register("127.0.0.1:9", server_id="d", address="a:1", model_config=CFG, tokenizer_id="t",
                      devices=1, timeout=1)


def test_a_server_names_how_it_runs_model_code_and_the_learner_keeps_it(learner, caplog):
  """The sandbox state a decode server registers with is what the learner's registry holds (for the
  run's summary.json), an unsandboxed one is logged at the learner, a server that runs no model code
  registers none, and a state that is not a JSON object is refused by name."""
  reg, address = learner
  sandboxed = {"sandboxed": True, "why": ""}
  unsandboxed = {"sandboxed": False, "why": "bubblewrap cannot create a user namespace here"}
  registry.register(address, server_id="decode-0", address="127.0.0.1:5001", model_config=CFG,
                    tokenizer_id="builtin-arithmetic-v1", devices=1, timeout=30, sandbox=sandboxed)
  with caplog.at_level("WARNING", logger="asyncrl_jax.rollout.registry"):
    registry.register(address, server_id="decode-1", address="127.0.0.1:5002", model_config=CFG,
                      tokenizer_id="builtin-arithmetic-v1", devices=1, timeout=30, sandbox=unsandboxed)
  _register(address, "decode-2", "127.0.0.1:5003")
  got = {s.server_id: s.sandbox for s in reg.servers()}
  assert got == {"decode-0": sandboxed, "decode-1": unsandboxed, "decode-2": {}}
  assert "decode-1" in caplog.text and "UNSANDBOXED" in caplog.text and "user namespace" in caplog.text
  assert "decode-0" not in caplog.text
  import grpc  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.infra import auth  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.rollout import protocol  # pylint: disable=import-outside-toplevel
  with auth.channel(address, None, protocol.GRPC_OPTIONS) as channel:
    call = channel.unary_unary(f"/{protocol.LEARNER_SERVICE}/Register",
                               request_serializer=protocol.MESSAGES["RegisterRequest"].SerializeToString,
                               response_deserializer=protocol.MESSAGES["RegisterReply"].FromString)
    with pytest.raises(grpc.RpcError, match="sandbox state is not a JSON object"):
      call(protocol.MESSAGES["RegisterRequest"](
          server_id="decode-3", address="127.0.0.1:5004", model_config_json=registry.model_config_json(CFG),
          tokenizer_id="builtin-arithmetic-v1", devices=1, sandbox_json="[1]"), timeout=30)

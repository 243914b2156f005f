"""Access: servers bind loopback unless given a shared-secret token, which every RPC must then carry
(compared in constant time); processes refuse a non-loopback bind without one, naming the option."""

import os
import subprocess
import sys

import grpc
import pytest

from asyncrl_jax import models

from asyncrl_jax.infra import auth
from asyncrl_jax.rollout import protocol, registry
from asyncrl_jax.rollout.grpc_service import RolloutClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=64)
TOKEN = "0123456789abcdef-secret"


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.9.1", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("learner-0.internal", False)])
def test_only_loopback_hosts_count_as_loopback(host, loopback):
  assert auth.is_loopback(host) is loopback


def test_tokens_from_env_or_file_and_bad_ones_named(tmp_path, monkeypatch):
  monkeypatch.delenv(auth.ENV, raising=False)
  assert auth.load_token() is None
  path = tmp_path / "token"
  path.write_text(TOKEN + "\n")
  assert auth.load_token(str(path)) == TOKEN
  monkeypatch.setenv(auth.ENV, TOKEN)
  assert auth.load_token() == TOKEN and auth.load_token(str(path)) == TOKEN
  monkeypatch.setenv(auth.ENV, TOKEN + "x")
  with pytest.raises(auth.AuthError, match="hold different tokens"):
    auth.load_token(str(path))
  monkeypatch.setenv(auth.ENV, "short")
  with pytest.raises(auth.AuthError, match="5 characters; use at least 16"):
    auth.load_token()
  monkeypatch.delenv(auth.ENV)
  (tmp_path / "empty").write_text("\n")
  with pytest.raises(auth.AuthError, match="is empty"):
    auth.load_token(str(tmp_path / "empty"))
  with pytest.raises(auth.AuthError, match="No such file"):
    auth.load_token(str(tmp_path / "missing"))
  with pytest.raises(auth.AuthError, match=r"rollout.host='0.0.0.0' is not a loopback address.*"
                                           r"ASYNCRL_AUTH_TOKEN"):
    auth.require("0.0.0.0", None, "rollout.host")
  auth.require("0.0.0.0", TOKEN, "rollout.host")
  auth.require("127.0.0.1", None, "rollout.host")


def _call_health(address, token):
  client = RolloutClient(address, token)
  try:
    return client.health(timeout=10)
  finally:
    client.close()


def test_every_rpc_needs_the_token_when_one_is_set():
  reg = registry.Registry(CFG, "tok-v1")
  server, port = reg.serve("127.0.0.1", 0, token=TOKEN)
  address = f"127.0.0.1:{port}"
  try:
    for token in (None, "wrong-token-0123456789", TOKEN[:-1]):
      with pytest.raises(grpc.RpcError) as e:
        registry.register(address, server_id="d0", address="127.0.0.1:1", model_config=CFG,
                          tokenizer_id="tok-v1", devices=1, timeout=10, token=token)
      assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "x-asyncrl-token" in e.value.details()
    assert reg.servers() == []
    assert registry.register(address, server_id="d0", address="127.0.0.1:1", model_config=CFG,
                             tokenizer_id="tok-v1", devices=1, timeout=10, token=TOKEN).registered == 1
  finally:
    server.stop(0)


def test_the_rollout_service_checks_the_token_on_every_method():
  from asyncrl_jax.rollout.grpc_service import serve  # pylint: disable=import-outside-toplevel

  class Service:  # answers everything: only the token check can refuse
    def __getattr__(self, name):
      return lambda request, context: protocol.MESSAGES[protocol.METHODS[name][1]]()

  server, port = serve(Service(), token=TOKEN)
  channel = grpc.insecure_channel(f"127.0.0.1:{port}")
  try:
    for name, (req, _, streaming) in protocol.METHODS.items():
      make = channel.unary_stream if streaming else channel.unary_unary
      call = make(f"/{protocol.SERVICE}/{name}", request_serializer=protocol.MESSAGES[req].SerializeToString)
      with pytest.raises(grpc.RpcError) as e:
        result = call(protocol.MESSAGES[req](), timeout=10)
        if streaming:
          list(result)
      assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
    assert _call_health(f"127.0.0.1:{port}", TOKEN).status == ""  # (the fake's empty reply)
  finally:
    channel.close()
    server.stop(0)


def test_binding_beyond_loopback_without_a_token_is_refused():
  from asyncrl_jax.rollout.grpc_service import serve  # pylint: disable=import-outside-toplevel
  with pytest.raises(auth.AuthError, match="not a loopback address"):
    serve(object(), host="0.0.0.0", port=0)


@pytest.mark.parametrize("cmd, option", [
    (["-m", "asyncrl_jax.rollout.main", f"--config={ROOT}/configs/default.py",
      "--config.rollout.host=0.0.0.0"], "rollout.host='0.0.0.0'"),
    (["-m", "asyncrl_jax.train", f"--config={ROOT}/configs/default.py", "--workdir=/tmp/unused",
      "--config.rollout.servers=1", "--config.rollout.host=0.0.0.0"], "rollout.host='0.0.0.0'"),
    (["-m", "asyncrl_jax.tools.serve", "--checkpoint=/tmp/unused", "--host=0.0.0.0"], "--host='0.0.0.0'")])
def test_processes_refuse_to_start_on_a_public_address_without_a_token(cmd, option):
  env = {k: v for k, v in os.environ.items() if k != auth.ENV}
  out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=env)
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1].startswith(f"error: {option} is not a loopback address")

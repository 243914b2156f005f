"""JetStream's own gRPC client gets the same greedy tokens from ``serve`` as direct decoding."""

import jax
import numpy as np
import pytest

from tests.fixtures.helpers import sharp_params
from asyncrl_jax import models
from asyncrl_jax.models.generate import greedy_generate
from asyncrl_jax.rollout.jetstream_compat import jetstream_pb2, jetstream_pb2_grpc
from asyncrl_jax.tools.export import ExportError, load_export, write_orbax
from asyncrl_jax.tools.serve import engine_for_checkpoint, start_server

CFG = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=128)


@pytest.fixture(scope="module", params=["hf", "orbax"])
def served(tmp_path_factory, request):
  import grpc
  path = str(tmp_path_factory.mktemp("export"))
  params = sharp_params(CFG, 4)
  # EOS (id 2) gets a logit near 0 while the max over the other 16 random logits is positive, so greedy
  # decoding runs for a while instead of stopping at once.
  params["lm_head"] = params["lm_head"].at[:, 2].multiply(1e-3)
  if request.param == "hf":
    models.export_hf(CFG, params, path)
  else:
    write_orbax(CFG, jax.device_get(params), path)
  engine, engine_params = engine_for_checkpoint(path, tokenizer_path="", slots=4, max_prefill_length=16,
                                                max_target_length=64, temperature=0.0)
  server, port = start_server(engine, engine_params)
  channel = grpc.insecure_channel(f"127.0.0.1:{port}")
  grpc.channel_ready_future(channel).result(timeout=60)
  yield params, jetstream_pb2_grpc.OrchestratorStub(channel)
  channel.close()
  server.stop()


def _decode(stub, token_ids, max_tokens):
  request = jetstream_pb2.DecodeRequest(
      token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=token_ids), max_tokens=max_tokens)
  out = []
  for response in stub.Decode(request, timeout=120):
    for sample in response.stream_content.samples:
      out.extend(sample.token_ids)
  return out


def test_jetstream_decode_matches_direct_greedy(served):
  params, stub = served  # the weights before export: the reference does not read the export
  config = CFG
  for prompt in ([5, 13, 7, 14], [3, 3, 13, 9, 13, 4, 14], [12]):
    got = _decode(stub, prompt, max_tokens=20)
    full = [1] + prompt  # JetStream prepends bos_id to token content
    tokens, lengths = greedy_generate(config, params, np.array([full + [0] * (16 - len(full))], np.int32),
                                      np.array([len(full)], np.int32), max_new_tokens=21, eos_id=2)
    want = [int(t) for t in np.asarray(tokens)[0, :int(lengths[0])] if t != 2]
    assert len(want) > 3, want  # a real sequence, not an immediate EOS
    assert got == want[:20]  # JetStream returns tokens before EOS, at most max_tokens of them


def test_jetstream_health_check(served):
  _, stub = served
  assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=30).is_live


def test_a_directory_without_an_export_is_named(tmp_path):
  with pytest.raises(ExportError, match="neither an Orbax export"):
    load_export(str(tmp_path))


def test_serving_with_a_token_refuses_calls_without_it(tmp_path):
  import grpc
  from asyncrl_jax.infra import auth  # pylint: disable=import-outside-toplevel
  write_orbax(CFG, jax.device_get(sharp_params(CFG, 1)), str(tmp_path))
  engine, engine_params = engine_for_checkpoint(str(tmp_path), tokenizer_path="", slots=2,
                                                max_prefill_length=16, max_target_length=32,
                                                temperature=0.0)
  token = "0123456789abcdef-serve"
  server, port = start_server(engine, engine_params, token=token)
  try:
    for sent in (None, "wrong-0123456789abcdef", token):
      channel = auth.channel(f"127.0.0.1:{port}", sent)
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)
      try:
        if sent == token:
          assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=30).is_live
        else:
          with pytest.raises(grpc.RpcError) as e:
            stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=30)
          assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
      finally:
        channel.close()
  finally:
    server.stop()

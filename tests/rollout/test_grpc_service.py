"""The rollout gRPC service in process, and a decode server in its own process receiving weights."""

import dataclasses
import os
import types
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.fixtures.helpers import sharp_params
from asyncrl_jax import config as config_lib, models
from asyncrl_jax.infra import sharding
from asyncrl_jax.rollout import DecodeServer, Engine, RolloutRequest, SamplingSettings, protocol
from asyncrl_jax.rollout.grpc_service import RolloutClient, RolloutService, serve
from asyncrl_jax.rollout.remote import RemoteRollout, eligible
from asyncrl_jax.weights import new_uuid, shards
from asyncrl_jax.weights.remote import Source, WeightSender

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=64)


def _greedy_reference(config, params, prompt, n, stop=2):
  seq = list(prompt)
  for _ in range(n):
    nxt = int(np.argmax(np.asarray(models.logits(config, params, np.array([seq], np.int32)))[0, -1]))
    seq.append(nxt)
    if nxt == stop:
      break
  return seq[len(prompt):]


@pytest.fixture()
def local_service():
  params = sharp_params(CFG, 0)
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(CFG, mesh=mesh, num_slots=4, max_prefill_length=16, max_target_length=48,
                  sampling=SamplingSettings(temperature=0.0), params=params)
  server = DecodeServer(engine, params, server_id="local")
  service = RolloutService(server)
  grpc_server, port = serve(service)
  server.start()
  client = RolloutClient(f"127.0.0.1:{port}")
  client.wait_ready(30)
  yield params, client, service
  client.close()
  grpc_server.stop(0)
  server.stop()


def test_grpc_submit_stream_health(local_service):
  params, client, service = local_service
  prompts = [[1, 3 + i, 5, 13] for i in range(6)]
  requests = [RolloutRequest(prompt_tokens=p, max_new_tokens=10, prompt_id=f"q{i}")
              for i, p in enumerate(prompts)]
  assert client.submit(requests) == 6
  got = {t.trajectory_id: t for t in client.stream(max_trajectories=6, timeout=120)}
  assert set(got) == {r.request_id for r in requests}
  for r in requests:
    t = got[r.request_id]
    assert list(t.completion_tokens) == _greedy_reference(CFG, params, r.prompt_tokens, 10)
    assert t.logprobs.dtype == np.float32 and len(t.versions) == len(t.completion_tokens)
    assert t.server_id == "local" and t.sampling["temperature"] == 0.0
  deadline = time.time() + 120
  while service.server.engine.compiles_pending() and time.time() < deadline:  # background compiles
    assert client.health().status in ("warming_up", "serving")  # (it may finish in between)
    time.sleep(0.05)
  health = client.health()
  assert health.status == "serving" and health.active == 0
  # the decode counters: every generated token was taken, slot-steps count all 4 slots of every step
  stats = health.stats
  assert stats.tokens == sum(len(t.completion_tokens) for t in got.values())
  assert stats.slot_steps == 4 * stats.steps and stats.steps >= 10 and stats.idle_seconds >= 0
  assert stats.weight_updates == 0 and stats.interrupt_seconds == 0
  assert stats.started == 6 and stats.finished_eos + stats.finished_length == 6


def test_remote_backend_sums_the_decode_servers_counters(local_service):
  _, client, service = local_service
  client.submit([RolloutRequest(prompt_tokens=[1, 4, 5, 13], max_new_tokens=6, prompt_id="q")])
  (t,) = list(client.stream(max_trajectories=1, timeout=120))
  health = client.health()
  # the same server twice: every counter is counted twice
  backend = RemoteRollout([client.address, client.address], types.SimpleNamespace(processes=1, base_id=0))
  try:
    stats = backend.decode_stats()
  finally:
    backend.stop()
  assert stats.servers == 2 and stats.tokens == 2 * health.stats.tokens == 2 * len(t.completion_tokens)
  assert stats.slot_steps == 2 * health.stats.slot_steps > 0
  assert stats.finished_eos + stats.finished_length == 2 * 1 and stats.started == 2
  # every counter of the record crosses the wire (a field missing from the proto reads as 0)
  one = protocol.stats_from_pb(health.stats)
  here = service.server.stats.copy()  # idle time keeps growing while the server waits
  assert dataclasses.replace(one, idle_seconds=0.0) == dataclasses.replace(here, idle_seconds=0.0)
  assert one.steps > 0 and one.started == 1


def test_stream_deadline_and_cancellation_lose_nothing(local_service):
  _, client, service = local_service
  import grpc
  with pytest.raises(grpc.RpcError) as e:
    list(client.stream(max_trajectories=1, timeout=0.5))  # nothing submitted: deadline passes
  assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
  requests = [RolloutRequest(prompt_tokens=[1, 4, 13], max_new_tokens=6) for _ in range(4)]
  client.submit(requests)
  first = next(iter(client.stream(timeout=60)))  # take one, then abandon the stream
  ids = {first.trajectory_id}
  for t in client.stream(timeout=60):  # whatever the abandoned stream held comes back
    ids.add(t.trajectory_id)
    if len(ids) == 4:
      break
  assert ids == {r.request_id for r in requests}
  assert service.outbox.empty()


@pytest.mark.slow(27)
def test_decode_server_process_pulls_weights_from_another_process(tmp_path):
  port_file = tmp_path / "port"
  env = dict(os.environ, ASYNCRL_CPU_DEVICES="2", XLA_FLAGS="--xla_force_host_platform_device_count=2")
  overrides = ["--config.rollout.temperature=0", "--config.rollout.num_slots=4",
               "--config.data.max_completion_len=24", "--config.seed=11"]
  proc = subprocess.Popen([sys.executable, "-m", "asyncrl_jax.rollout.main",
                           f"--config={ROOT}/configs/default.py", f"--port_file={port_file}",
                           "--server_id=proc-0", *overrides],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.time() + 120
    while not port_file.exists():
      assert proc.poll() is None, proc.stdout.read()[-3000:]
      assert time.time() < deadline, "decode server did not start"
      time.sleep(0.2)
    client = RolloutClient(f"127.0.0.1:{port_file.read_text()}")
    client.wait_ready(30)
    from configs.default import get_config  # pylint: disable=import-outside-toplevel
    model = config_lib.model_config(get_config())
    learner_mesh = sharding.make_mesh(jax.devices()[:2], dict(data=1, fsdp=-1, tensor=1))
    # Sharded on a learner mesh, and not the server's seed-11 init.
    new_params = sharp_params(model, 12345, scale=4.0, mesh=learner_mesh)
    sender = WeightSender("127.0.0.1:0")
    leaves = jax.tree.leaves(new_params)
    planned = shards.plan(leaves, [x.sharding for x in leaves])
    uuid = new_uuid()
    sender.offer(new_params, planned, uuid)
    source = Source(sender.address, uuid, tuple(b for b, _ in planned))
    reply = client.update_weights(1, [source], timeout=120)
    assert reply.version == 1 and reply.bytes == sum(x.nbytes for x in leaves)
    assert list(reply.source_bytes) == [reply.bytes]
    prompt = [1, 5, 13, 7, 14]
    request = RolloutRequest(prompt_tokens=prompt, max_new_tokens=12)
    client.submit([request])
    (t,) = list(client.stream(max_trajectories=1, timeout=120))
    assert t.trajectory_id == request.request_id and set(t.versions) == {1}
    assert list(t.completion_tokens) == _greedy_reference(model, new_params, prompt, 12)
    assert client.health().version == 1
  finally:
    proc.terminate()
    proc.wait(30)


def test_only_servers_at_most_one_version_behind_get_work():
  assert eligible([3, 2, 1], published=3) == [0, 1]
  assert eligible([3, None, 3], published=3) == [0, 2]  # no weights yet: no work
  assert eligible([1, 1], published=3) == [0, 1]  # every server behind: none is held back for good
  assert eligible([None, None], published=None) == [0, 1]


def test_malformed_and_oversized_messages_are_refused_and_the_server_lives_on(local_service):
  """Random bytes to every method (hypothesis-style fuzzing with a fixed seed), a message over the
  size limit, and requests that parse but are nonsense: each gets an error status or a failed
  trajectory, never a crash, and the server then still serves."""
  import grpc
  _, client, service = local_service
  channel = grpc.insecure_channel(client.address, options=protocol.GRPC_OPTIONS)
  rng = np.random.default_rng(0)
  try:
    for name, (_, _, streaming) in protocol.METHODS.items():
      make = channel.unary_stream if streaming else channel.unary_unary
      call = make(f"/{protocol.SERVICE}/{name}")  # raw bytes, no serializer
      for n in (1, 7, 64, 1000):
        try:
          result = call(rng.bytes(n), timeout=2)
          if streaming:
            list(result)
        except grpc.RpcError as e:  # unparsable, a bad value, or (Stream) nothing within the deadline
          assert e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT,
                              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.UNKNOWN), (name, e.code())
    big = channel.unary_unary(f"/{protocol.SERVICE}/Submit")
    with pytest.raises(grpc.RpcError) as e:
      big(b"\x0a" + b"\xff" * (protocol.MAX_MESSAGE_BYTES + 16), timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
  finally:
    channel.close()
  # requests that parse but cannot be served: failed trajectories with the reason, not a crash
  client.submit([RolloutRequest(prompt_tokens=[99, 1], max_new_tokens=4, request_id="oov"),
                 RolloutRequest(prompt_tokens=[1, 2], max_new_tokens=0, request_id="zero"),
                 RolloutRequest(prompt_tokens=[], max_new_tokens=4, request_id="empty")])
  got = {t.trajectory_id: t for t in client.stream(max_trajectories=3, timeout=60)}
  assert "outside [0, 17)" in got["oov"].error and "must be >= 1" in got["zero"].error
  assert got["empty"].error == "empty prompt" and all(t.finish_reason == "error" for t in got.values())
  assert client.health().status == "serving" and service.server.error is None


class _HandingReceiver:
  """A weight receiver that hands over the parameters it holds (no transfer)."""

  def __init__(self, params):
    self.params = params

  def pull(self, sources, spec, keep=None):
    del sources, spec, keep
    return self.params, types.SimpleNamespace(bytes=1, seconds=0.0, per_source=[1])

  def forget(self, address):
    del address


def test_a_newer_learner_incarnation_takes_over_at_an_older_version_and_its_predecessors_work_is_dropped():
  """The server serves one learner incarnation: a newer one's weights are accepted at any version
  and drop the older one's queue, sequences in flight and undelivered trajectories; an older one's
  notices and requests are refused. Draining refuses work and gives the queue back."""
  import grpc
  from asyncrl_jax.rl.trajectory import DRAINED  # pylint: disable=import-outside-toplevel
  params = sharp_params(CFG, 0)
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(CFG, mesh=mesh, num_slots=2, max_prefill_length=16, max_target_length=48,
                  sampling=SamplingSettings(temperature=1.0), params=params)
  server = DecodeServer(engine, None, version=-1, server_id="s")
  service = RolloutService(server, _HandingReceiver(params))
  grpc_server, port = serve(service)
  server.start()
  client = RolloutClient(f"127.0.0.1:{port}")
  source = [Source("127.0.0.1:1", 5, ())]

  def requests(n, incarnation, prefix, max_new=40):
    return [RolloutRequest([1, 5, 6], max_new, request_id=f"{prefix}{i}", incarnation=incarnation)
            for i in range(n)]

  def health_is(version, incarnation):
    deadline = time.time() + 30
    while (client.health().version, client.health().incarnation) != (version, incarnation):
      assert time.time() < deadline, client.health()
      time.sleep(0.02)

  try:
    client.wait_ready(30)
    with pytest.raises(grpc.RpcError) as e:  # no learner's weights yet
      client.submit(requests(1, 100, "early"))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "serves incarnation 0" in e.value.details()
    assert client.update_weights(5, source, incarnation=100).version == 5
    health_is(5, 100)
    with pytest.raises(grpc.RpcError) as e:  # the same learner must move forward
      client.update_weights(5, source, incarnation=100)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    client.submit(requests(1, 100, "a"))
    (t,) = list(client.stream(max_trajectories=1, timeout=60))
    assert (t.trajectory_id, t.incarnation, set(t.versions.tolist())) == ("a0", 100, {5})
    client.submit(requests(8, 100, "old"))  # 2 in flight, 6 queued: then the learner restarts
    assert client.update_weights(2, source, incarnation=200).version == 2  # an older version
    health_is(2, 200)
    with pytest.raises(grpc.RpcError) as e:
      client.submit(requests(1, 100, "zombie"))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as e:
      client.update_weights(9, source, incarnation=100)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "older than the one served" in e.value.details()
    client.submit(requests(1, 200, "new", max_new=4))
    got = list(client.stream(max_trajectories=1, timeout=60))
    assert [(t.trajectory_id, t.incarnation) for t in got] == [("new0", 200)]
    assert set(got[0].versions.tolist()) == {2}
    deadline = time.time() + 30
    while server.num_active or server.num_queued:
      assert time.time() < deadline, "the old learner's work was not dropped"
      time.sleep(0.05)
    # draining: queued work comes back aborted (DRAINED), new work is refused
    client.submit(requests(6, 200, "q", max_new=40))
    assert service.drain() >= 1
    assert client.health().status == "draining"
    with pytest.raises(grpc.RpcError) as e:
      client.submit(requests(1, 200, "late"))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    back = list(client.stream(max_trajectories=6, timeout=60))
    assert sorted(t.trajectory_id for t in back) == [f"q{i}" for i in range(6)]
    drained = [t for t in back if t.finish_reason == "aborted"]
    assert drained and all(t.error == DRAINED for t in drained)
    assert all(t.finish_reason in ("eos", "length") for t in back if t not in drained)
  finally:
    client.close()
    grpc_server.stop(0)
    server.stop()


def test_a_lora_server_pulls_the_full_weights_once_then_the_adapters_alone():
  """The publisher's partial offer moves the adapters alone (< 5% of the bytes here) and the server
  keeps the base it pulled before: with the learner's copy of the base altered after the full pull
  (the control: were the base to cross, the server would decode with it), the server decodes with
  the first base and the new adapters. A partial notice for another base, or to a server holding
  none, is refused and changes nothing."""
  import grpc
  from flax import traverse_util
  from asyncrl_jax.learner.publisher import WeightPublisher
  from asyncrl_jax.models import lora
  from asyncrl_jax.weights.remote import WeightReceiver
  cfg = CFG.replace(lora_rank=2, lora_alpha=4.0, lora_targets=("q", "v"))
  learner_mesh = sharding.make_mesh(jax.devices()[:2], dict(data=1, fsdp=-1, tensor=1))
  learner = types.SimpleNamespace(model_config=cfg, check_version=lambda *a: None,
                                  params=models.init_params(cfg, jax.random.key(1), mesh=learner_mesh))
  publisher = WeightPublisher(learner, "127.0.0.1", processes=1, gather=lambda a: [a],
                              offer_op=lambda v, uuids, partial: publisher.offer_here(v, uuids, partial))
  engine = Engine(cfg, mesh=sharding.make_mesh(jax.devices()[2:4], dict(data=-1, fsdp=1, tensor=1)),
                  num_slots=2, max_prefill_length=16, max_target_length=48,
                  sampling=SamplingSettings(temperature=0.0), params=models.init_params(cfg, jax.random.key(2)))
  server = DecodeServer(engine, engine.load_params(), server_id="lora")
  service = RolloutService(server, WeightReceiver())
  grpc_server, port = serve(service)
  server.start()
  client = RolloutClient(f"127.0.0.1:{port}")

  def push(version, partial, base_id=publisher.base_id):
    uuid = new_uuid()
    publisher.offer(version, [uuid], [partial])
    return client.update_weights(version, publisher.sources(uuid, partial), timeout=60,
                                 base_id=base_id, partial=partial)

  def altered(params, adapters: bool):
    rng = np.random.default_rng(int(adapters))
    return traverse_util.unflatten_dict({
        k: (v + jax.numpy.asarray(rng.normal(size=v.shape), v.dtype) if lora.is_adapter(k) == adapters
            else v) for k, v in traverse_util.flatten_dict(params).items()})

  try:
    client.wait_ready(30)
    assert publisher.base_id > 0
    with pytest.raises(grpc.RpcError, match="holds base none: it needs the full weights"):
      push(1, True)  # a server holding no base of this learner
    full = push(1, False)
    first = learner.params
    learner.params = altered(altered(first, adapters=True), adapters=False)  # adapters trained; base "changed"
    part = push(2, True)
    adapter_bytes = sum(x.nbytes for x in lora.split(learner.params)[0].values())
    assert part.bytes == adapter_bytes < 0.05 * full.bytes, (part.bytes, full.bytes)
    with pytest.raises(grpc.RpcError, match=f"adapters for base {publisher.base_id + 1}, but this server holds base {publisher.base_id}"):
      push(3, True, base_id=publisher.base_id + 1)
    adapters, _ = lora.split(learner.params)
    expect = traverse_util.unflatten_dict(lora.split(first)[1] | adapters)  # the first base, new adapters
    prompt = [1, 5, 13, 7, 14]
    request = RolloutRequest(prompt_tokens=prompt, max_new_tokens=10)
    client.submit([request])
    (t,) = list(client.stream(max_trajectories=1, timeout=120))
    assert set(t.versions) == {2}
    assert list(t.completion_tokens) == _greedy_reference(cfg, expect, prompt, 10)
    assert list(t.completion_tokens) != _greedy_reference(cfg, learner.params, prompt, 10)  # (control)
  finally:
    client.close()
    grpc_server.stop(0)
    server.stop()

"""The decode server: continuous batching, interruptible weight updates, termination, errors."""

import threading

import jax
import numpy as np
import pytest

from tests.fixtures.helpers import NoStopTokenizer, sharp_params
from asyncrl_jax import models
from asyncrl_jax.infra import sharding
from asyncrl_jax.rl.logprobs import compute_logprobs
from asyncrl_jax.rollout import DecodeServer, Engine, RolloutRequest, SamplingSettings
from asyncrl_jax.tokenization import ArithmeticTokenizer

CFG = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=64)


def _params(seed, scale=3.0):
  return sharp_params(CFG, seed, scale)


@pytest.fixture(scope="module")
def params_a():
  return _params(0)


@pytest.fixture(scope="module")
def params_b():
  return _params(1)


def _server(params, *, temperature=1.0, slots=4, tokenizer=None, steps_per_call=16,
            on_weight_update="recompute"):
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(CFG, mesh=mesh, num_slots=slots, max_prefill_length=16, max_target_length=48,
                  sampling=SamplingSettings(temperature=temperature), params=params, seed=5,
                  tokenizer=tokenizer or ArithmeticTokenizer())
  return DecodeServer(engine, params, steps_per_call=steps_per_call, on_weight_update=on_weight_update)


def _greedy_with_update(params_a, params_b, on_weight_update):
  """One greedy request of 12 tokens; weights switch to ``params_b`` (version 7) after 5 iterations."""
  server = _server(params_a, temperature=0.0, tokenizer=NoStopTokenizer(), steps_per_call=1,
                   on_weight_update=on_weight_update)
  (request,) = _requests(1, max_new=12, seed=3)
  server.submit(request)
  for _ in range(5):
    server.iteration()
  server.update_weights(params_b, version=7)
  server.run_until_idle()
  (t,) = _drain(server)
  return server, request, t


def _requests(n, max_new=20, seed=0):
  rng = np.random.default_rng(seed)
  return [RolloutRequest(prompt_tokens=[1] + list(rng.integers(3, 17, int(rng.integers(2, 8)))),
                         max_new_tokens=max_new, prompt_id=f"p{i}", group_id=i // 2) for i in range(n)]


def _drain(server):
  out = []
  while not server.finished.empty():
    out.append(server.finished.get())
  return out


def _recompute(params, traj):
  seq = np.concatenate([traj.prompt_tokens, traj.completion_tokens])[None]
  lp = compute_logprobs(CFG, params, seq, np.arange(seq.shape[1])[None], np.ones_like(seq))
  return np.asarray(lp)[0, len(traj.prompt_tokens):]


def test_interrupted_trajectories_record_versions_and_new_logprobs(params_a, params_b):
  server = _server(params_a, tokenizer=NoStopTokenizer(), steps_per_call=4)
  requests = _requests(6, max_new=20)
  server.submit(*requests)
  for _ in range(3):  # fill 4 slots, then two chunks (6 requests: 2 wait in the queue)
    server.iteration()
  server.update_weights(params_b, version=1)
  server.run_until_idle()
  trajectories = _drain(server)
  assert sorted(t.trajectory_id for t in trajectories) == sorted(r.request_id for r in requests)
  interrupted = [t for t in trajectories if t.num_interruptions]
  assert len(interrupted) == 4
  for t in trajectories:
    assert t.finish_reason == "length" and len(t.completion_tokens) == 20
    assert np.all(np.diff(t.versions) >= 0)
    lp_a, lp_b = _recompute(params_a, t), _recompute(params_b, t)
    v0 = t.versions == 0
    np.testing.assert_allclose(t.logprobs[v0], lp_a[v0], atol=3e-5)
    np.testing.assert_allclose(t.logprobs[~v0], lp_b[~v0], atol=3e-5)
  switch = {t.version_segments()[0][2] for t in interrupted}
  assert len(switch) == 1  # all four were interrupted at the same step
  (m,) = switch
  assert 0 < m < 20
  for t in interrupted:
    assert t.version_segments() == [(0, 0, m), (1, m, 20)]
    assert abs(_recompute(params_a, t)[m:] - t.logprobs[m:]).max() > 1e-3  # really new weights
  assert server.stats.interrupted_sequences == 4


@pytest.mark.slow(23)
def test_greedy_interrupt_continues_exactly_as_a_fresh_prefill(params_a, params_b):
  _, request, t = _greedy_with_update(params_a, params_b, "recompute")
  m = int(np.argmax(t.versions == 7))
  assert 0 < m < 12
  seq = list(request.prompt_tokens)
  for i in range(12):
    p = params_a if i < m else params_b
    seq.append(int(np.argmax(np.asarray(models.logits(CFG, p, np.array([seq], np.int32)))[0, -1])))
  assert list(t.completion_tokens) == seq[len(request.prompt_tokens):]
  assert list(t.versions) == [0] * m + [7] * (12 - m)


def test_keep_cache_update_continues_on_the_old_cache_without_re_prefill(params_a, params_b):
  server, request, t = _greedy_with_update(params_a, params_b, "keep_cache")
  assert server.stats.interrupted_sequences == 0 and server.stats.continued_sequences == 1
  assert t.num_interruptions == 0
  # The first token after the update is drawn from logits the old weights computed: it keeps version 0.
  s = int(np.argmax(t.versions == 7)) - 1
  assert 0 < s < 11 and list(t.versions) == [0] * (s + 1) + [7] * (11 - s)
  # Independent reference: a plain cached decode that switches weights at step s and keeps its cache.
  prompt = np.asarray(request.prompt_tokens, np.int32)
  cache = models.init_cache(CFG, 1, 48)
  logits, cache = models.decode(CFG, params_a, prompt[None], np.arange(len(prompt))[None], cache)
  nxt, want = np.asarray(logits)[0, -1], []
  for i in range(12):
    want.append(int(np.argmax(nxt)))
    p = params_a if i < s else params_b
    logits, cache = models.decode(CFG, p, np.array([[want[-1]]]), np.array([[len(prompt) + i]]), cache)
    nxt = np.asarray(logits)[0, -1]
  assert list(t.completion_tokens) == want
  # ... and it differs from what a re-prefill under the new weights would have produced
  seq = list(prompt)
  for i in range(12):
    w = params_a if i <= s else params_b
    seq.append(int(np.argmax(np.asarray(models.logits(CFG, w, np.array([seq], np.int32)))[0, -1])))
  assert seq[len(prompt):] != want


@pytest.mark.slow(24)
@pytest.mark.parametrize("mode", ["recompute", "keep_cache", "drain"])
def test_requests_submitted_after_an_update_never_see_the_old_weights(params_a, params_b, mode):
  # The controller publishes version 1 and then admits work for it; the loop may be between taking
  # updates and filling slots. Nothing submitted after the publish may be prefilled with version 0.
  server = _server(params_a, tokenizer=NoStopTokenizer(), on_weight_update=mode)
  server.submit(*_requests(2, max_new=6, seed=4))
  server.iteration()  # two sequences in flight under version 0
  server.update_weights(params_b, version=1)
  late = _requests(2, max_new=6, seed=5)
  server.submit(*late)
  server._fill_slots()  # pylint: disable=protected-access  (the fill that races the publish)
  assert server.num_active == 2
  server.run_until_idle()
  out = {t.trajectory_id: t for t in _drain(server)}
  for r in late:
    assert out[r.request_id].versions.min() == 1
    np.testing.assert_allclose(out[r.request_id].logprobs, _recompute(params_b, out[r.request_id]),
                               atol=3e-5)


def test_drain_finishes_the_sequences_in_flight_on_the_old_weights_before_switching(params_a, params_b):
  server = _server(params_a, tokenizer=NoStopTokenizer(), on_weight_update="drain", steps_per_call=1)
  early = _requests(2, max_new=10, seed=4)
  server.submit(*early)
  server.iteration()
  server.iteration()  # both in flight under version 0
  server.update_weights(params_b, version=1)
  late = _requests(2, max_new=6, seed=5)
  server.submit(*late)
  server.iteration()
  assert server.version == 0 and server.num_active == 2  # the update waits; nothing new starts
  server.run_until_idle()
  assert server.version == 1 and server.stats.interrupted_sequences == 0
  assert server.stats.drain_seconds > 0 and server.stats.weight_updates == 1
  out = {t.trajectory_id: t for t in _drain(server)}
  for r in early:  # uninterrupted, every token from the old weights, log-probs those of version 0
    t = out[r.request_id]
    assert t.num_interruptions == 0 and t.versions.tolist() == [0] * 10
    np.testing.assert_allclose(t.logprobs, _recompute(params_a, t), atol=3e-5)
  for r in late:
    assert out[r.request_id].versions.tolist() == [1] * 6
    np.testing.assert_allclose(out[r.request_id].logprobs, _recompute(params_b, out[r.request_id]),
                               atol=3e-5)


def test_on_weight_update_is_checked(params_a):
  server = _server(params_a)
  with pytest.raises(ValueError, match="on_weight_update='sometimes'"):
    DecodeServer(server.engine, params_a, on_weight_update="sometimes")


def test_continuous_batching_keeps_slots_busy_and_stops_at_eos(params_a):
  server = _server(params_a, steps_per_call=1)
  requests = _requests(16, max_new=24, seed=1)
  server.submit(*requests)
  server.run_until_idle()
  out = _drain(server)
  assert len(out) == 16 and len({t.trajectory_id for t in out}) == 16
  for t in out:
    assert t.finish_reason in ("eos", "length")
    if t.finish_reason == "eos":
      assert t.completion_tokens[-1] == 2 and 2 not in t.completion_tokens[:-1]
    else:
      assert len(t.completion_tokens) == 24
    assert t.logprob_source == "sampling" and t.sampling["temperature"] == 1.0
    assert t.tokenizer_id == "builtin-arithmetic-v1" and t.group_id >= 0
  idle = server.stats.slot_steps - server.stats.tokens
  # A finished slot idles for one step (the step launched before its result was read), then is refilled;
  # otherwise slots idle only once the queue has run dry at the end (at most 4 slots x 24 steps).
  assert idle <= 16 * 1 + 4 * 24


def test_server_without_weights_holds_requests_until_the_first_update(params_a):
  server = _server(params_a)
  weightless = DecodeServer(server.engine, None, version=-1)
  assert weightless.current_params is None
  weightless.submit(*_requests(6, max_new=10, seed=2))
  for _ in range(3):
    weightless.iteration(block=False)
  assert weightless.num_active == 0 and weightless.num_queued == 6 and weightless.finished.empty()
  # A weight pull needs shapes and shardings only: the engine's spec matches real parameters.
  spec = weightless.engine.param_spec()
  placed = server.engine.place_params(params_a)
  assert jax.tree.structure(spec) == jax.tree.structure(placed)
  for s, p in zip(jax.tree.leaves(spec), jax.tree.leaves(placed)):
    assert (s.shape, s.dtype, s.sharding) == (p.shape, p.dtype, p.sharding)
  weightless.update_weights(params_a, 0)
  weightless.run_until_idle()
  out = _drain(weightless)
  assert len(out) == 6
  for t in out:
    assert t.finish_reason in ("eos", "length") and set(t.versions.tolist()) == {0}
    assert t.num_interruptions == 0
    np.testing.assert_allclose(t.logprobs, _recompute(params_a, t), atol=2e-4)


def test_bad_requests_finish_with_an_error_and_abort_returns_partial_tokens(params_a):
  server = _server(params_a, tokenizer=NoStopTokenizer(), steps_per_call=4)
  too_long = RolloutRequest(prompt_tokens=[1] * 17, max_new_tokens=4)
  too_many = RolloutRequest(prompt_tokens=[1, 3], max_new_tokens=47)
  bad_id = RolloutRequest(prompt_tokens=[1, 99], max_new_tokens=4)
  keep = RolloutRequest(prompt_tokens=[1, 3, 4], max_new_tokens=30)
  server.submit(too_long, too_many, bad_id, keep)
  for _ in range(3):
    server.iteration()
  server.abort(keep.request_id)
  server.run_until_idle()
  out = {t.trajectory_id: t for t in _drain(server)}
  assert "more than the engine's max_prefill_length=16" in out[too_long.request_id].error
  assert "exceeds the cache length" in out[too_many.request_id].error
  assert "outside [0, 17)" in out[bad_id.request_id].error
  assert out[keep.request_id].finish_reason == "aborted"
  assert 0 < len(out[keep.request_id].completion_tokens) < 30  # the tokens so far are kept


def test_threaded_server_streams_to_a_callback(params_a, params_b):
  got, done = [], threading.Event()

  def on_trajectory(t):
    got.append(t)
    if len(got) == 8:
      done.set()

  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(CFG, mesh=mesh, num_slots=4, max_prefill_length=16, max_target_length=48,
                  params=params_a)
  server = DecodeServer(engine, params_a, on_trajectory=on_trajectory).start()
  server.submit(*_requests(8, max_new=16, seed=4))
  server.update_weights(params_b, version=1)
  assert done.wait(120)
  server.stop()
  assert server.error is None and len(got) == 8
  with pytest.raises(ValueError, match="not newer"):
    server.update_weights(params_b, version=1)


class _ImplicitCopyServer(DecodeServer):
  """A decode server with an implicit host-to-device copy planted in its loop (a numpy array passed
  straight to a jitted function), the kind of bug the loop's transfer guard exists to catch."""

  def _fill_slots(self):
    jax.jit(lambda x: x + 1)(np.ones(3, np.int32))
    super()._fill_slots()


@pytest.mark.parametrize("planted", [False, True])
def test_the_decode_thread_refuses_implicit_transfers(params_a, planted):
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(CFG, mesh=mesh, num_slots=4, max_prefill_length=16, max_target_length=48,
                  params=params_a)
  got, done = [], threading.Event()

  def on_trajectory(t):
    got.append(t)
    if len(got) == 4:
      done.set()

  server = (_ImplicitCopyServer if planted else DecodeServer)(engine, params_a,
                                                             on_trajectory=on_trajectory)
  server.submit(*_requests(4, max_new=6, seed=2))
  server.start()  # the guard is the loop thread's own: this thread may copy implicitly
  assert done.wait(120)
  server.stop()
  if planted:
    assert "Disallowed host-to-device transfer" in repr(server.error)
    assert {t.finish_reason for t in got} == {"error"}
  else:
    assert server.error is None and {t.finish_reason for t in got} <= {"eos", "length"}


def test_a_restart_drops_the_previous_learners_work_but_not_requests_queued_after_it(params_a, params_b):
  """``restart`` (a new learner's weights, here at an older version) drops what was queued and in
  flight; a request queued after it survives a further update that arrives before either is applied."""
  server = _server(params_a, temperature=0.0)
  server.update_weights(params_a, version=9)
  old = _requests(6, max_new=20, seed=4)
  server.submit(*old)
  server.iteration()  # some of the previous learner's requests start
  assert server.num_active
  server.update_weights(params_b, version=3, restart=True)  # older: a restored checkpoint's
  assert server.num_queued == 0
  (new,) = _requests(1, max_new=6, seed=5)
  server.submit(new)
  server.update_weights(params_b, version=4)  # before the restart was applied
  assert server.num_queued == 1
  server.run_until_idle()
  got = _drain(server)
  assert [t.trajectory_id for t in got] == [new.request_id]  # nothing of the previous learner's
  assert set(got[0].versions.tolist()) == {4} and server.version == 4


def test_slot_utilization_by_hand():
  from asyncrl_jax.rollout.stats import DecodeStats  # pylint: disable=import-outside-toplevel
  two = DecodeStats(tokens=300, slot_steps=400, idle_seconds=5.0, servers=2)
  # occupancy 300/400 of the steps run, times the share of 10 s the 2 servers were not idle (2.5 s each)
  assert two.slot_utilization(10.0) == pytest.approx(0.75 * 0.75)
  # idle all the time (an idle wait straddling the start counts whole): 0, never negative
  assert DecodeStats(tokens=10, slot_steps=20, idle_seconds=12.0).slot_utilization(10.0) == 0.0
  assert DecodeStats().slot_utilization(10.0) is None  # no decode step yet

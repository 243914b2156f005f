"""A decode server of a mixture-of-experts policy records each token's experts (routing replay): the
routes a trajectory carries are those a full forward pass over it chooses, across continuous
batching, a re-prefill after a weight update and an episode's observations."""

import jax
import numpy as np
import pytest

from asyncrl_jax import models
from asyncrl_jax.infra import sharding
from asyncrl_jax.rollout import DecodeServer, Engine, RolloutRequest, SamplingSettings
from asyncrl_jax.tokenization import ArithmeticTokenizer
from tests.fixtures.helpers import NoStopTokenizer, sharp_params

CFG = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, max_seq_len=64, qkv_bias=False, qk_norm=True,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def params_a():
  return sharp_params(CFG, 0, 3.0)


@pytest.fixture(scope="module")
def params_b():
  return sharp_params(CFG, 1, 3.0)


def _server(params, *, tokenizer=None, steps_per_call=4, record=True, mesh_shape=None):
  mesh = sharding.make_mesh(jax.devices()[:2], mesh_shape or dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(CFG, mesh=mesh, num_slots=4, max_prefill_length=16, max_target_length=48,
                  sampling=SamplingSettings(temperature=1.0), params=params, seed=5,
                  tokenizer=tokenizer or ArithmeticTokenizer(), record_routes=record)
  return DecodeServer(engine, params, steps_per_call=steps_per_call)


def _requests(n, max_new=14, seed=0):
  rng = np.random.default_rng(seed)
  return [RolloutRequest(prompt_tokens=[1] + list(rng.integers(3, 17, int(rng.integers(2, 8)))),
                         max_new_tokens=max_new, prompt_id=f"p{i}", group_id=i) for i in range(n)]


def _drain(server):
  out = []
  while not server.finished.empty():
    out.append(server.finished.get())
  return out


def _full_routes(params, t):
  tokens = np.r_[t.prompt_tokens, t.completion_tokens][None].astype(np.int32)
  return np.asarray(models.logits_and_routes(CFG, params, tokens)[1][0])


def test_recorded_routes_are_the_full_forward_passes(params_a):
  server = _server(params_a)
  server.submit(*_requests(6))  # more requests than slots: slots are refilled mid-run
  server.run_until_idle()
  trajectories = _drain(server)
  assert len(trajectories) == 6
  for t in trajectories:
    n = len(t.prompt_tokens) + len(t.completion_tokens)
    assert t.routes.shape == (n, 2, 2) and t.routes.dtype == np.int16
    np.testing.assert_array_equal(t.routes, _full_routes(params_a, t))


def test_an_expert_parallel_server_records_the_full_forward_passes_routes(params_a):
  server = _server(params_a, mesh_shape=dict(expert=2))  # 4 experts per shard, slots over 2
  server.submit(*_requests(5, seed=1))
  server.run_until_idle()
  trajectories = _drain(server)
  assert len(trajectories) == 5
  for t in trajectories:
    np.testing.assert_array_equal(t.routes, _full_routes(params_a, t))


def test_after_a_re_prefill_the_routes_are_the_new_weights(params_a, params_b):
  server = _server(params_a, tokenizer=NoStopTokenizer(), steps_per_call=1)
  (request,) = _requests(1, max_new=12, seed=3)
  server.submit(request)
  for _ in range(5):
    server.iteration()
  server.update_weights(params_b, version=1)  # re-prefills the prefix under params_b
  server.run_until_idle()
  (t,) = _drain(server)
  assert set(t.versions.tolist()) == {0, 1}
  # the prefix was recomputed by params_b, every later token decoded by it: all routes are b's
  np.testing.assert_array_equal(t.routes, _full_routes(params_b, t))
  assert np.any(_full_routes(params_a, t) != t.routes)  # the control: a's routes differ


def test_a_dense_model_or_an_engine_without_recording_carries_no_routes(params_a):
  server = _server(params_a, record=False)
  server.submit(*_requests(2))
  server.run_until_idle()
  assert all(t.routes is None for t in _drain(server))
  dense = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=96, num_layers=1,
                             num_heads=4, num_kv_heads=2)
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=-1, fsdp=1, tensor=1))
  with pytest.raises(ValueError, match="record_routes=True needs a mixture-of-experts model"):
    Engine(dense, mesh=mesh, num_slots=2, max_prefill_length=8, max_target_length=16,
           tokenizer=ArithmeticTokenizer(), record_routes=True)


@pytest.mark.slow(30)
def test_under_bfloat16_serving_replay_closes_the_routing_part_of_the_log_prob_gap(params_a):
  """A bfloat16 decode server and a float32 learner at the same weights: some tokens' experts flip
  between the two (the control), replay gives the learner the server's experts everywhere, and the
  learner's log-probs of the sampled tokens come closer to the server's."""
  from asyncrl_jax.rl.logprobs import token_logprobs  # pylint: disable=import-outside-toplevel
  served = CFG.replace(dtype="bfloat16")
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(served, mesh=mesh, num_slots=4, max_prefill_length=16, max_target_length=48,
                  sampling=SamplingSettings(temperature=1.0), params=params_a, seed=5,
                  tokenizer=NoStopTokenizer(), record_routes=True)
  server = DecodeServer(engine, params_a, steps_per_call=8)
  server.submit(*_requests(8, max_new=24, seed=4))
  server.run_until_idle()
  trajectories = _drain(server)
  gaps = {"replay": [], "own": []}
  flips, pairs = 0, 0
  for t in trajectories:
    tokens = np.r_[t.prompt_tokens, t.completion_tokens][None].astype(np.int32)
    positions = np.arange(tokens.shape[1])[None].astype(np.int32)
    segments = np.ones_like(tokens)
    own = np.asarray(models.logits_and_routes(CFG, params_a, tokens)[1][0])
    flips += int(np.sum(np.any(np.sort(own, -1) != np.sort(t.routes, -1), axis=-1)))
    pairs += own.shape[0] * own.shape[1]
    for name, routes in (("replay", t.routes[None]), ("own", None)):
      logp, moe_out = token_logprobs(CFG, params_a, tokens, positions, segments, routes_btlk=routes,
                                     with_moe=True)
      if routes is not None:
        np.testing.assert_array_equal(np.asarray(moe_out.routes[0]), t.routes)
      gaps[name].append(np.abs(np.asarray(logp[0, len(t.prompt_tokens):]) - t.logprobs))
  gap = {k: float(np.mean(np.concatenate(v))) for k, v in gaps.items()}
  print(f"bf16 serving, fp32 learner: {flips} of {pairs} token-layer routes flip; mean |logp gap| "
        f"{gap['own']:.4f} without replay, {gap['replay']:.4f} with")
  assert flips > 0  # the control: without replay the learner routes some tokens elsewhere
  assert gap["replay"] < gap["own"]

"""Routing replay on the learner's side: routes travel with a trajectory (wire format, checks,
batching, the multi-process broadcast) and the objective replays them, with the router's
load-balancing term and the routing mismatch in its metrics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl_jax import models
from asyncrl_jax.controller.checks import check_trajectory
from asyncrl_jax.learner.group import pack_sequences, unpack_sequences
from asyncrl_jax.rl import batching
from asyncrl_jax.rl.objective import LossSettings, micro_batch_loss
from asyncrl_jax.rl.trajectory import RolloutRequest, Trajectory
from asyncrl_jax.rollout import protocol
from tests.fixtures.helpers import sharp_params

CFG = models.ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, max_seq_len=64, qkv_bias=False, qk_norm=True,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)


@pytest.fixture(scope="module")
def params():
  return sharp_params(CFG, 0, scale=3.0)


def _trajectory(prompt=4, completion=6, routes=True, seed=0) -> Trajectory:
  rng = np.random.default_rng(seed)
  n = prompt + completion
  r = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(n)])
  return Trajectory(trajectory_id=f"t{seed}", prompt_id="p", group_id=0,
                    prompt_tokens=rng.integers(3, 40, prompt).astype(np.int32),
                    completion_tokens=rng.integers(3, 40, completion).astype(np.int32),
                    logprobs=np.full(completion, -1.0, np.float32), versions=np.zeros(completion, np.int32),
                    finish_reason="eos", logprob_source="sampler", sampling={}, tokenizer_id="x",
                    routes=r.astype(np.int16) if routes else None)


def test_routes_cross_the_wire_and_count_in_the_trajectory_bytes():
  t = _trajectory()
  back = protocol.trajectory_from_pb(protocol.trajectory_to_pb(t))
  assert back.routes.dtype == np.int16
  np.testing.assert_array_equal(back.routes, t.routes)
  assert t.nbytes - _trajectory(routes=False).nbytes == 10 * 2 * 2 * 2  # tokens x layers x k x int16
  assert protocol.trajectory_from_pb(protocol.trajectory_to_pb(_trajectory(routes=False))).routes is None
  # a message whose routes do not fill their shape is a malformed trajectory, not a crash
  m = protocol.trajectory_to_pb(t)
  m.routes = m.routes[:-2]
  bad = protocol.trajectory_from_pb(m)
  assert bad.finish_reason == "error" and "routes" in bad.error


def test_a_trajectory_refuses_routes_of_the_wrong_length():
  t = _trajectory()
  with pytest.raises(ValueError, match="routes must be int16"):
    dataclasses.replace(t, routes=t.routes[:-1])


def test_the_controller_checks_the_routes():
  t = _trajectory()
  request = RolloutRequest(prompt_tokens=list(t.prompt_tokens), max_new_tokens=10, request_id="t0")
  check = lambda traj: check_trajectory(traj, request, vocab_size=40, newest_version=0, routes=(2, 2, 8))
  assert check(t) == ""
  assert "no routes" in check(dataclasses.replace(t, routes=None))
  bad = t.routes.copy()
  bad[3, 1, 0] = 8
  assert "outside [0, 8)" in check(dataclasses.replace(t, routes=bad))
  bad = t.routes.copy()
  bad[3, 1] = 5
  assert "routed twice" in check(dataclasses.replace(t, routes=bad))
  assert "not [tokens, 3 MoE layers" in check_trajectory(t, request, vocab_size=40, newest_version=0,
                                                          routes=(3, 2, 8))


def _sequences(n=3):
  out = []
  for i in range(n):
    t = _trajectory(prompt=3 + i, completion=5 + 2 * i, seed=i)
    out.append(batching.make_sequence(t.prompt_tokens, t.completion_tokens, logprobs=t.logprobs,
                                      versions=t.versions, advantage=1.0 - i, routes=t.routes))
  return out


def test_batching_lays_routes_out_beside_their_tokens_and_the_broadcast_keeps_them():
  seqs = _sequences()
  batch = batching.layout_rows(seqs, [[0, 1], [2]], 3, 32)
  assert batch.routes.shape == (3, 32, 2, 2) and batch.routes.dtype == np.int16
  n0, n1 = len(seqs[0].tokens), len(seqs[1].tokens)
  np.testing.assert_array_equal(batch.routes[0, n0:n0 + n1], seqs[1].routes)
  np.testing.assert_array_equal(batch.routes[2, 5], [[0, 1], [0, 1]])  # padding: experts 0..k-1
  padded = batching.pad_rows(batch, 4)
  assert padded.routes.shape == (4, 32, 2, 2)
  with pytest.raises(batching.PackingError, match="have no routes"):
    batching.layout_rows([seqs[0], seqs[1]._replace(routes=None)], [[0, 1]], 1, 32)
  back = unpack_sequences(pack_sequences(seqs), (2, 2))
  for a, b in zip(seqs, back):
    np.testing.assert_array_equal(a.routes, b.routes)
  assert unpack_sequences(pack_sequences([s._replace(routes=None) for s in seqs]))[0].routes is None


def _loss(params, batch, settings, normalizer=20.0):
  return micro_batch_loss(params, batch, None, jnp.float32(normalizer), model=CFG, settings=settings,
                          prox_is_current=True)


def test_the_objective_replays_recorded_routes_and_reports_the_mismatch(params):
  seqs = _sequences()
  tokens_batch = batching.layout_rows(seqs, [[0], [1], [2]], 3, 24)
  # the routes the learner itself chooses: replaying them changes nothing, and nothing mismatches
  own = models.logits_and_routes(CFG, params, tokens_batch.tokens, positions=tokens_batch.positions,
                                 segment_ids=tokens_batch.segment_ids)[1]
  mine = tokens_batch._replace(routes=np.asarray(own))
  replay = LossSettings(route_shape=(2, 2), replay_routes=True)
  record_only = LossSettings(route_shape=(2, 2), replay_routes=False)
  loss_own, m_own = _loss(params, mine, replay)
  loss_free, m_free = _loss(params, mine, record_only)
  assert float(m_own["moe_route_mismatch"]) == 0.0 and float(m_free["moe_route_mismatch"]) == 0.0
  np.testing.assert_allclose(loss_own, loss_free, rtol=1e-5)
  # the recorded (random) routes: replay moves the loss, and the mismatch is large either way
  loss_rep, m_rep = _loss(params, tokens_batch, replay)
  _, m_rec = _loss(params, tokens_batch, record_only)
  assert abs(float(loss_rep) - float(loss_own)) > 1e-4
  assert float(m_rep["moe_route_mismatch"]) > 0.5 and float(m_rec["moe_route_mismatch"]) > 0.5
  for key in ("moe_aux_loss", "moe_load_max", "moe_load/0", "moe_load/7"):
    assert key in m_rep
  assert sum(float(m_rep[f"moe_load/{e}"]) for e in range(8)) == pytest.approx(1.0, abs=1e-5)


def test_the_load_balancing_term_trains_the_router(params):
  batch = batching.layout_rows(_sequences(), [[0], [1], [2]], 3, 24)
  settings = LossSettings(route_shape=(2, 2), replay_routes=True)
  grad = lambda s: jax.grad(lambda p: _loss(p, batch, s)[0])(params)["layer_0"]["mlp"]["router"]
  without, with_term = grad(settings), grad(dataclasses.replace(settings, moe_aux_coef=1.0))
  assert float(jnp.abs(with_term - without).max()) > 1e-6
  # the term is the loss times its coefficient, weighted by the micro-batch's share of the tokens
  base, m = _loss(params, batch, settings)
  term, _ = _loss(params, batch, dataclasses.replace(settings, moe_aux_coef=1.0))
  share = float(np.sum(batch.mask)) / 20.0
  assert float(term - base) == pytest.approx(float(m["moe_aux_loss"]) * share, rel=1e-4)

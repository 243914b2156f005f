"""The Learner on a mixture-of-experts policy with recorded routes, on a sharded mesh: a version
trains through the packing, the prox pass and the update with the routes placed beside the tokens,
and replaying them changes the update (the learner's own routes differ from these)."""

import jax
import numpy as np
import pytest

from asyncrl_jax import config as config_lib
from asyncrl_jax.infra import sharding
from asyncrl_jax.learner.learner import Learner
from asyncrl_jax.rl import batching
from tests.fixtures.helpers import max_abs_diff, random_sequences, sharp_params


def _config(replay: bool):
  c = config_lib.base_config()
  c.model.update(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=8, max_seq_len=128, qkv_bias=False, qk_norm=True)
  c.model.moe.update(num_experts=4, top_k=2, intermediate_size=16, matmul="ragged", aux_loss_coef=0.01)
  c.rollout.record_routes = True
  c.rl.update(loss="decoupled_ppo", replay_routes=replay)
  c.learner.update(ppo_minibatches=2, token_budget=128, learning_rate=3e-2, grad_clip=1e6)
  return c


def _with_routes(sequences, seed=0):
  rng = np.random.default_rng(seed)
  return [s._replace(routes=np.stack([np.stack([rng.choice(4, 2, replace=False) for _ in range(2)])
                                      for _ in range(len(s.tokens))]).astype(np.int16))
          for s in sequences]


@pytest.mark.slow(25)
def test_a_version_trains_on_replayed_routes_over_a_sharded_mesh():
  config = _config(replay=True)
  m = config_lib.model_config(config)
  params = sharp_params(m, 4, scale=2.0)
  sequences = _with_routes(random_sequences(0, 8, m.vocab_size))
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  replayed = Learner(m, params, mesh, config, versions=config.steps)
  assert replayed.updater.abstract_micro_batch(64).routes.shape[2:] == (2, 2)
  metrics = replayed.train(sequences, version=0)
  for key in ("moe_aux_loss", "moe_load_max", "moe_load/3", "moe_route_mismatch"):
    assert np.isfinite(metrics[key])
  assert metrics["moe_route_mismatch"] > 0.3  # random routes: most differ from the learner's own
  own = Learner(m, params, mesh, _config(replay=False), versions=config.steps)
  own.train(sequences, version=0)
  assert max_abs_diff(replayed.params, params) > 1e-3
  assert max_abs_diff(replayed.params, own.params) > 1e-4  # replay changed the update
  # expert parallel (the experts split over 2 shards, rows over 2 x 1): the same update
  parallel = Learner(m, params, sharding.make_mesh(jax.devices()[:2], {"expert": 2}), config,
                     versions=config.steps)
  assert parallel.params["layer_0"]["mlp"]["experts_up"].sharding.spec[0] == "expert"
  parallel_metrics = parallel.train(sequences, version=0)
  for key in ("loss", "moe_aux_loss", "moe_route_mismatch"):
    np.testing.assert_allclose(parallel_metrics[key], metrics[key], rtol=1e-4, atol=1e-6)
  # (AdamW's first steps are about lr x sign(gradient): float noise in a near-zero gradient moves an
  # element by up to lr, so the parameters agree to a share of the update, not to float precision)
  update = max_abs_diff(replayed.params, params)
  assert max_abs_diff(parallel.params, replayed.params) < 0.01 * update
  with pytest.raises(batching.PackingError, match="of a minibatch has no routes of \\[tokens, 2 MoE layers"):
    replayed.train([sequences[0], sequences[1]._replace(routes=None)], version=1)

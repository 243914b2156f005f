"""The value model: alignment against an independent forward, packing invariance, A = R - V through
GAE, a value loss that falls, frozen attention, explained variance by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.fixtures.helpers import sharp_params
from asyncrl_jax import models
from asyncrl_jax.models import api
from asyncrl_jax.models.value import (explained_variance, init_value_params, token_values,
                                      value_optimizer)
from asyncrl_jax.rl import advantages

CFG = models.ModelConfig(vocab_size=17, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=64)


@pytest.fixture(scope="module")
def value_params():
  p = init_value_params(sharp_params(CFG, 0, scale=2.0))
  rng = np.random.default_rng(0)
  p["head"] = {"w": jnp.asarray(rng.normal(0, 0.3, 32), jnp.float32), "b": jnp.float32(0.25)}
  return p


def _packed():
  """One row holding two sequences (5 and 7 tokens) and padding."""
  rng = np.random.default_rng(1)
  a, b = rng.integers(0, 17, 5), rng.integers(0, 17, 7)
  tokens = np.zeros((1, 16), np.int32)
  tokens[0, :5], tokens[0, 5:12] = a, b
  positions = np.zeros_like(tokens)
  positions[0, :5], positions[0, 5:12] = np.arange(5), np.arange(7)
  segments = np.zeros_like(tokens)
  segments[0, :5], segments[0, 5:12] = 1, 2
  return a, b, tokens, positions, segments


@pytest.mark.slow(27)
def test_values_are_the_hidden_state_before_each_token_through_the_head(value_params):
  a, b, tokens, positions, segments = _packed()
  v = np.asarray(token_values(CFG, value_params, tokens, positions, segments))
  # independent: the policy's own logits with the head written into vocabulary column 0
  trunk = dict(value_params["trunk"])
  trunk["lm_head"] = trunk["lm_head"].at[:, 0].set(value_params["head"]["w"])
  for seq, start in ((a, 0), (b, 5)):
    logits = api.apply_logits(CFG, trunk, jnp.asarray(seq[None], jnp.int32),
                              jnp.arange(len(seq))[None], jnp.ones((1, len(seq)), jnp.int32))
    want = np.asarray(logits)[0, :-1, 0] + 0.25  # V(s_t) from the state after tokens < t
    np.testing.assert_allclose(v[0, start + 1:start + len(seq)], want, rtol=1e-5, atol=1e-5)
    assert v[0, start] == 0.0  # a segment's first token has no state before it
  assert np.all(v[0, 12:] == 0.0)  # padding


def test_a_fresh_value_model_copies_the_policy_and_predicts_zero():
  policy = sharp_params(CFG, 3)
  fresh = init_value_params(policy)
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(fresh["trunk"]), jax.tree.leaves(policy)))
  _, _, tokens, positions, segments = _packed()
  assert np.all(np.asarray(token_values(CFG, fresh, tokens, positions, segments)) == 0.0)


def test_single_rollout_advantages_are_reward_minus_value(value_params):
  """GAE with gamma = lambda = 1 and the reward on the last token gives A_t = R - V(s_t) on every
  action token: in particular A at the first completion token is R - V(prompt)."""
  _, _, tokens, positions, segments = _packed()
  v = token_values(CFG, value_params, tokens, positions, segments)
  mask = np.zeros((1, 16), np.float32)
  mask[0, 2:5], mask[0, 7:12] = 1, 1  # completions: the last 3 tokens of a, the last 5 of b
  rewards = np.zeros((1, 16), np.float32)
  rewards[0, 4], rewards[0, 11] = 1.0, 0.0  # each sequence's reward on its last token
  # one trajectory per row in GAE: score each sequence as its own row
  for sl, r in ((slice(0, 5), 1.0), (slice(5, 12), 0.0)):
    adv, returns = advantages.gae(rewards[:, sl], v[:, sl], mask[:, sl], np.array([True]), np.zeros(1),
                                  gamma=1.0, lam=1.0)
    on = mask[0, sl] > 0
    np.testing.assert_allclose(np.asarray(adv)[0, on], r - np.asarray(v)[0, sl][on], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(returns)[0, on], r, rtol=1e-6, atol=1e-6)


def test_the_clipped_value_loss_falls_on_a_fixed_batch_with_attention_frozen(value_params):
  _, _, tokens, positions, segments = _packed()
  mask = (segments > 0) & (positions > 0)
  returns = jnp.where(segments == 1, 1.0, -0.5)  # each sequence's return
  optimizer = value_optimizer(optax.adam(3e-3), value_params, freeze_attention=True)

  def loss_fn(p, old):
    v = token_values(CFG, p, tokens, positions, segments)
    return advantages.clipped_value_loss(v, old, returns, mask, clip_eps=0.2)

  @jax.jit
  def step(p, state):
    old = token_values(CFG, p, tokens, positions, segments)  # the values before this update
    loss, g = jax.value_and_grad(loss_fn)(p, old)
    updates, state = optimizer.update(g, state, p)
    return optax.apply_updates(p, updates), state, loss

  p, state = value_params, optimizer.init(value_params)
  losses = []
  for _ in range(40):
    p, state, loss = step(p, state)
    losses.append(float(loss))
  assert losses[-1] < 0.1 * losses[0]
  for name, leaf in p["trunk"]["layer_0"]["attn"].items():  # frozen: not a bit moved
    assert np.array_equal(leaf, value_params["trunk"]["layer_0"]["attn"][name]), name
  assert not np.array_equal(p["trunk"]["layer_0"]["mlp"]["up"], value_params["trunk"]["layer_0"]["mlp"]["up"])
  assert not np.array_equal(p["head"]["w"], value_params["head"]["w"])


def test_explained_variance_by_hand():
  returns = np.array([1.0, 0.0, 1.0, 0.0, 5.0])
  mask = np.array([1, 1, 1, 1, 0])  # the last token is not counted
  assert float(explained_variance(returns, returns, mask)) == pytest.approx(1.0)
  assert float(explained_variance(np.full(5, 0.5), returns, mask)) == pytest.approx(0.0)
  values = np.array([0.8, 0.1, 0.6, 0.3, 0.0])
  err = returns[:4] - values[:4]
  assert float(explained_variance(values, returns, mask)) == pytest.approx(1 - err.var() / returns[:4].var())
  assert float(explained_variance(values, np.ones(5), mask)) == 0.0  # returns that do not vary

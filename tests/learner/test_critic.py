"""The learner's critic (rl.advantage="value"): advantages against an independent forward pass, the
value loss falling, value pre-training leaving the policy as it was, and exact resume of the value
model from a checkpoint."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fixtures.helpers import random_sequences, sharp_params
from asyncrl_jax import config as config_lib, models
from asyncrl_jax.infra import sharding
from asyncrl_jax.learner.learner import Learner
from asyncrl_jax.models import api
from asyncrl_jax.rl import batching
from asyncrl_jax.train.checkpoint import Checkpointer

CFG = models.ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=128)


def _config(**rl):
  c = config_lib.base_config()
  c.rl.update(dict(dict(loss="dis", advantage="value", group_size=1, value_pretrain_versions=0), **rl))
  c.learner.update(token_budget=128, learning_rate=1e-3, batch_size=12)
  return c


def _rewarded(seed, n=12):
  """Random trajectories with a 0/1 reward on each last token (``make_sequence(token_reward=)``)."""
  rng = np.random.default_rng(seed)
  out = []
  for s in random_sequences(seed, n, CFG.vocab_size):
    prompt = int(np.sum(s.mask == 0))
    seq = batching.make_sequence(s.tokens[:prompt], s.tokens[prompt:], logprobs=s.behav_logp[prompt:],
                                 versions=s.versions[prompt:], token_reward=float(rng.integers(0, 2)))
    out.append(seq)
  return out


def _mesh():
  return sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})


def _learner(config, seed=4):
  learner = Learner(CFG, sharp_params(CFG, seed, scale=2.0), _mesh(), config, versions=config.steps)
  # a non-zero head, so that the values (and the test) are not trivially 0
  rng = np.random.default_rng(seed)
  params = jax.device_get(learner.critic.params)
  params["head"] = {"w": rng.normal(0, 0.3, CFG.hidden_size).astype(np.float32), "b": np.float32(0.2)}
  learner.critic.params = jax.device_put(params, learner.critic.updater.param_shardings)
  return learner


def _independent_values(value_params, seq) -> np.ndarray:
  """V(s_t) at each token of one unpacked sequence, by hand: the trunk's hidden state at t - 1 times
  the head, plus its bias (0 where t has no context)."""
  n = len(seq.tokens)
  hidden, _ = api.apply_hidden(CFG, value_params["trunk"], jnp.asarray(seq.tokens)[None],
                               jnp.arange(n)[None], jnp.ones((1, n), jnp.int32))
  head = value_params["head"]
  v = np.asarray(hidden[0], np.float64) @ np.asarray(head["w"], np.float64) + float(head["b"])
  return np.r_[0.0, v[:-1]]


def _per_sequence(learner, sequences, arrays):
  """Splits packed ``[R, L]`` arrays (one per micro-batch, in ``place``'s plan) back into sequences."""
  plan = batching.plan_micro_batches([len(s.tokens) for s in sequences], learner.updater.token_budget)
  out = {}
  for mb, arr in zip(plan.micro_batches, arrays):
    arr = np.asarray(arr)
    for r, row in enumerate(mb):
      start = 0
      for i in row:
        n = len(sequences[i].tokens)
        out[i] = arr[r, start:start + n]
        start += n
  return [out[i] for i in range(len(sequences))]


@pytest.mark.slow(100)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_advantages_are_the_discounted_reward_minus_an_independent_value_forward(gamma):
  learner = _learner(_config(gamma=gamma, gae_lambda=1.0))
  sequences = _rewarded(5)
  mbs, _ = learner.updater.place(sequences)
  estimates = learner.critic.estimate(mbs)
  advantages = _per_sequence(learner, sequences, [a for a, _, _ in estimates])
  values = _per_sequence(learner, sequences, [v for _, _, v in estimates])
  params = jax.device_get(learner.critic.params)
  checked = 0
  for seq, adv, val in zip(sequences, advantages, values):
    reward = float(seq.advantages[-1])
    expect_v = _independent_values(params, seq)
    actions = np.flatnonzero(seq.mask)
    # with lambda = 1 and the reward on the last action: A_t = gamma^(actions after t) R - V(s_t)
    to_go = reward * gamma ** (len(actions) - 1 - np.arange(len(actions)))
    np.testing.assert_allclose(val[actions], expect_v[actions], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(adv[actions], to_go - expect_v[actions], rtol=1e-4, atol=1e-5)
    assert not np.any(adv[seq.mask == 0])  # nothing off the policy tokens
    checked += len(actions)
  assert checked > 100 and np.std(np.concatenate(values)) > 0.05  # the values are not trivial


@pytest.mark.slow(49)
def test_the_policy_trains_on_the_critics_advantages():
  """The policy update sees ``R - V``, not the rewards: a critic that predicts every reward exactly
  leaves zero advantages, so the policy loss and its gradient are 0."""
  config = _config()
  learner = _learner(config)
  sequences = _rewarded(6)
  before = jax.device_get(learner.params)
  learner.critic.params = jax.device_put(jax.tree.map(jnp.zeros_like, learner.critic.params),
                                         learner.critic.updater.param_shardings)
  zero_value = learner.train(sequences, version=0)  # V = 0: A = R, a real update
  assert abs(zero_value["loss"]) > 1e-3
  # a head bias of R for a batch whose rewards are all R: A = 0 everywhere
  learner = _learner(config)
  same = [s._replace(advantages=np.where(np.arange(len(s.tokens)) == len(s.tokens) - 1, 1.0, 0.0)
                     .astype(np.float32)) for s in sequences]
  params = jax.device_get(learner.critic.params)
  params["head"] = {"w": np.zeros(CFG.hidden_size, np.float32), "b": np.float32(1.0)}
  learner.critic.params = jax.device_put(params, learner.critic.updater.param_shardings)
  metrics = learner.train(same, version=0)
  assert metrics["loss"] == 0.0
  assert metrics["grad_norm"] == 0.0
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(learner.params))):
    np.testing.assert_allclose(a, b, atol=2e-6)  # (AdamW's weight decay alone moves them a little)


@pytest.mark.slow(26)
def test_value_pretraining_lowers_the_value_loss_and_leaves_the_policy_unchanged():
  config = _config(value_pretrain_versions=6, value_updates=2, value_learning_rate=1e-3)
  learner = _learner(config)
  before = jax.device_get(learner.params)
  sequences = _rewarded(7)
  losses = [learner.train(sequences, version=v) for v in range(6)]
  assert all(m["policy_trained"] == 0.0 for m in losses)
  assert "loss" not in losses[0]  # no policy update was made
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(learner.params))):
    np.testing.assert_array_equal(a, b)
  assert learner.version == 6
  assert losses[-1]["value_loss"] < 0.5 * losses[0]["value_loss"]
  assert losses[-1]["value_explained_variance"] > losses[0]["value_explained_variance"]
  after = learner.train(sequences, version=6)  # the first version that trains the policy
  assert after["policy_trained"] == 1.0 and abs(after["loss"]) > 0
  # the value model is the learner's alone: the published weights are the policy's layout
  assert jax.tree.structure(learner.params) == jax.tree.structure(before)


@pytest.mark.slow(46)
def test_exact_resume_of_the_value_model(tmp_path):
  config = _config(value_pretrain_versions=1)
  learner = _learner(config)
  for v in range(2):
    learner.train(_rewarded(10 + v), version=v)
  ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(2, state=learner.checkpoint_state(), meta={"version": 2})
  learner.train(_rewarded(12), version=2)
  uninterrupted = jax.device_get(learner.checkpoint_state())

  fresh = _learner(config, seed=9)  # other weights: only the checkpoint can make them equal
  state, meta = ckpt.restore(2, state_like=fresh.checkpoint_state())
  fresh.load_checkpoint_state(state)
  fresh.version = meta["version"]
  fresh.train(_rewarded(12), version=2)
  resumed = jax.device_get(fresh.checkpoint_state())
  assert set(resumed) == {"params", "opt_state", "value_params", "value_opt_state"}
  for a, b in zip(jax.tree.leaves(uninterrupted), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(a, b)

  # a run with group advantages has no value model to restore into, and is told so
  group = config_lib.base_config()
  group.learner.token_budget = 128
  plain = Learner(CFG, sharp_params(CFG, 4), _mesh(), group, versions=10)
  with pytest.raises(ValueError, match="value_params"):
    ckpt.restore(2, state_like=plain.checkpoint_state())
  ckpt.close()


@pytest.mark.slow(72)
def test_held_out_explained_variance_by_hand():
  learner = _learner(_config())
  sequences = _rewarded(8)
  got = learner.critic.explained_variance(sequences)
  params = jax.device_get(learner.critic.params)
  values, returns = [], []
  for s in sequences:
    actions = np.flatnonzero(s.mask)
    values.append(_independent_values(params, s)[actions])
    returns.append(np.full(len(actions), s.advantages[-1]))
  v, r = np.concatenate(values), np.concatenate(returns)
  assert got["value_explained_variance"] == pytest.approx(1 - np.var(r - v) / np.var(r), abs=1e-4)
  assert got["value_mean"] == pytest.approx(v.mean(), abs=1e-5)


def test_value_figures_from_moments_merged_over_micro_batches():
  """The value figures a version reports come from per-micro-batch statistics (readable in every
  process); merged over parts of the tokens they give numpy's figures on all of them, and 0 for
  returns that do not vary, even a constant float32 cannot hold over many tokens."""
  from asyncrl_jax.learner import critic  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  v, r = rng.normal(0.4, 0.3, (3, 50)), rng.integers(0, 2, (3, 50)).astype(np.float64)
  mask = rng.random((3, 50)) < 0.7
  mask[2] = False  # a micro-batch of padding only
  v[~mask] = np.nan  # masked-out positions never count, not even as NaN
  parts = [np.asarray(critic.value_moments(v[i], r[i], mask[i])) for i in range(3)]
  got = critic.value_metrics(critic.merge_moments(parts))
  vm, rm = v[mask], r[mask]
  assert got["value_explained_variance"] == pytest.approx(1 - np.var(rm - vm) / np.var(rm), abs=1e-5)
  assert got["value_mean"] == pytest.approx(vm.mean(), abs=1e-6)
  assert got["return_mean"] == pytest.approx(rm.mean(), abs=1e-6)
  values = rng.normal(0.3, 0.1, (4, 5000))
  constant = [np.asarray(critic.value_moments(values[i], np.full(5000, 0.3), np.ones(5000)))
              for i in range(4)]
  same = critic.value_metrics(critic.merge_moments(constant))
  assert same["value_explained_variance"] == 0.0 and same["return_mean"] == pytest.approx(0.3)
  assert critic.value_metrics(critic.merge_moments([]))["value_mean"] == 0.0

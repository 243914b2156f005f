"""Advantages against hand-computed values and a plain-Python reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl_jax.rl import advantages as adv_lib


def test_group_advantages_hand_computed():
  rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
  ids = [0, 0, 0, 0, 1, 1]
  adv, counts = adv_lib.group_advantages(np.array(rewards), np.array(ids), num_groups=2)
  np.testing.assert_allclose(np.asarray(adv), [0.5, -0.5, -0.5, 0.5, 0.0, 0.0])
  np.testing.assert_array_equal(np.asarray(counts), [4, 4, 4, 4, 2, 2])
  # host math: numpy out, nothing placed on (or copied from) a device
  assert type(adv) is np.ndarray and type(counts) is np.ndarray  # pylint: disable=unidiomatic-typecheck
  adv, _ = adv_lib.group_advantages(np.array(rewards), np.array(ids), num_groups=2,
                                    scale_by_std=True, eps=0.0 + 1e-12)
  np.testing.assert_allclose(np.asarray(adv)[:4], [1.0, -1.0, -1.0, 1.0], rtol=1e-5)  # std 0.5
  np.testing.assert_array_equal(np.asarray(adv)[4:], [0.0, 0.0])  # all-equal group: no signal


def test_group_advantages_match_numpy_and_detect_incomplete_groups():
  rng = np.random.default_rng(0)
  ids = np.repeat(np.arange(5), 4)
  rng.shuffle(ids)
  rewards = rng.normal(size=20)
  adv, _ = adv_lib.group_advantages(np.array(rewards), np.array(ids), num_groups=5, scale_by_std=True)
  for g in range(5):
    r = rewards[ids == g]
    np.testing.assert_allclose(np.asarray(adv)[ids == g], (r - r.mean()) / (r.std() + 1e-6), rtol=1e-4)
  assert adv_lib.incomplete_groups(ids, 4) == []
  assert adv_lib.incomplete_groups(ids[1:], 4) == [int(ids[0])]


def test_value_baseline_seed_example():
  # Reward 1; easy task V = 0.9 -> A = 0.1; hard task V = 0.2 -> 0.8; an overshooting critic flips sign.
  np.testing.assert_allclose(
      np.asarray(adv_lib.value_baseline_advantages(jnp.array([1.0, 1.0, 1.0]),
                                                   jnp.array([0.9, 0.2, 1.3]))), [0.1, 0.8, -0.3],
      rtol=1e-6)
  mask = jnp.array([[0, 1, 1], [0, 0, 1]])
  np.testing.assert_allclose(np.asarray(adv_lib.broadcast_to_tokens(jnp.array([2.0, -1.0]), mask)),
                             [[0, 2, 2], [0, 0, -1]])


def py_gae(rewards, values, mask, terminated, bootstrap, gamma, lam):
  """Reference: collect the action steps of a row, then the textbook backward recursion."""
  out = np.zeros_like(rewards)
  for b in range(rewards.shape[0]):
    steps = [t for t in range(rewards.shape[1]) if mask[b, t]]
    # rewards on non-action tokens belong to the previous action
    r_eff = {t: 0.0 for t in steps}
    for t in range(rewards.shape[1]):
      prev = [s for s in steps if s <= t]
      if prev:
        r_eff[prev[-1]] += rewards[b, t]
    next_v = 0.0 if terminated[b] else bootstrap[b]
    next_a = 0.0
    for t in reversed(steps):
      delta = r_eff[t] + gamma * next_v - values[b, t]
      next_a = delta + gamma * lam * next_a
      out[b, t] = next_a
      next_v = values[b, t]
  return out


def test_gae_hand_computed():
  # One row, actions at t = 1, 2 (t = 0 prompt, t = 3 tool output), reward 1 at the end, terminated.
  rewards = np.array([[0.0, 0.0, 1.0, 0.0]])
  values = np.array([[0.0, 0.5, 0.8, 0.0]])
  mask = np.array([[0, 1, 1, 0]])
  adv, ret = adv_lib.gae(rewards, values, mask, np.array([True]), np.array([7.0]), gamma=0.9, lam=0.5)
  # t=2: delta = 1 - 0.8 = 0.2, A = 0.2.  t=1: delta = 0 + 0.9*0.8 - 0.5 = 0.22, A = 0.22 + 0.45*0.2 = 0.31
  np.testing.assert_allclose(np.asarray(adv), [[0.0, 0.31, 0.2, 0.0]], atol=1e-6)
  np.testing.assert_allclose(np.asarray(ret), [[0.0, 0.81, 1.0, 0.0]], atol=1e-6)
  # Truncated instead: bootstrap 7 enters at the last action: delta_2 = 1 + 0.9*7 - 0.8 = 6.5
  adv, _ = adv_lib.gae(rewards, values, mask, np.array([False]), np.array([7.0]), gamma=0.9, lam=0.5)
  assert float(adv[0, 2]) == pytest.approx(6.5, abs=1e-5)


def test_gae_matches_reference_with_skips():
  rng = np.random.default_rng(3)
  b, t = 4, 12
  rewards = rng.normal(size=(b, t)) * (rng.uniform(size=(b, t)) < 0.3)
  values = rng.normal(size=(b, t))
  mask = (rng.uniform(size=(b, t)) < 0.6).astype(np.int32)
  mask[:, 0] = 0
  terminated = np.array([True, False, True, False])
  bootstrap = rng.normal(size=b)
  for gamma, lam in ((1.0, 1.0), (0.99, 0.95), (0.5, 0.0)):
    adv, ret = adv_lib.gae(rewards, values, mask, terminated, bootstrap, gamma=gamma, lam=lam)
    want = py_gae(rewards, values, mask, terminated, bootstrap, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), np.where(mask > 0, want + values, 0), rtol=1e-5,
                               atol=1e-5)


def test_gae_over_packed_rows_equals_gae_of_each_trajectory_alone():
  rng = np.random.default_rng(4)
  lengths = [5, 3, 6]  # three trajectories in one row, then 2 padding tokens
  parts = []
  for n in lengths:
    mask = (rng.uniform(size=n) < 0.7).astype(np.int32)
    mask[0] = 0
    rewards = np.zeros(n)
    rewards[-1] = rng.normal()  # the reward on the trajectory's last token (may be a non-action)
    parts.append((rewards, rng.normal(size=n), mask))
  cat = lambda i, pad: np.concatenate([p[i] for p in parts] + [np.full(2, pad)])[None]
  seg = np.concatenate([np.full(n, k + 1) for k, n in enumerate(lengths)] + [np.zeros(2)])[None]
  for gamma, lam in ((1.0, 1.0), (0.9, 0.7)):
    packed, packed_ret = adv_lib.gae(cat(0, 0.0), cat(1, 0.0), cat(2, 0), np.array([True]), np.zeros(1),
                                     gamma=gamma, lam=lam, segment_ids_bt=seg)
    start = 0
    for rewards, values, mask in parts:
      alone, alone_ret = adv_lib.gae(rewards[None], values[None], mask[None], np.array([True]),
                                     np.zeros(1), gamma=gamma, lam=lam)
      n = len(rewards)
      np.testing.assert_allclose(np.asarray(packed)[0, start:start + n], np.asarray(alone)[0], atol=1e-6)
      np.testing.assert_allclose(np.asarray(packed_ret)[0, start:start + n], np.asarray(alone_ret)[0],
                                 atol=1e-6)
      start += n
    # without segment ids the same row is one trajectory: values leak across the boundaries
    leaky, _ = adv_lib.gae(cat(0, 0.0), cat(1, 0.0), cat(2, 0), np.array([True]), np.zeros(1),
                           gamma=gamma, lam=lam)
    assert np.max(np.abs(np.asarray(leaky) - np.asarray(packed))) > 1e-2


def test_clipped_value_loss_hand_computed():
  values = jnp.array([1.0, 0.0, 0.5])
  old = jnp.array([0.0, 0.0, 0.5])
  returns = jnp.array([2.0, 1.0, 0.5])
  mask = jnp.array([1.0, 1.0, 0.0])
  # token 0: max((1-2)^2, (0.2-2)^2) = 3.24 -> 1.62; token 1: max(1, 1) = 1 -> 0.5; mean over 2 = 1.06
  loss = adv_lib.clipped_value_loss(values, old, returns, mask, clip_eps=0.2)
  assert float(loss) == pytest.approx(1.06, rel=1e-6)


def test_group_ids_out_of_range_are_refused():
  with pytest.raises(ValueError, match=r"group ids must lie in \[0, 2\)"):
    adv_lib.group_advantages(np.zeros(3), np.array([0, 1, 2]), num_groups=2)

"""The selection-bias monitor: zeroed policy tokens by completion length and staleness, by hand, and
as the learner reports them for DIS."""

import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl_jax.rl import losses
import jax

from asyncrl_jax.rl.selection import counts_of, device_counts, selection_counts, selection_metrics


def test_counts_and_fractions_of_a_hand_made_micro_batch():
  # row 0: sequence 1 = 2 prompt + 3 completion tokens, sequence 2 = 1 prompt + 20 completion tokens;
  # row 1: sequence 1 = 1 prompt + 4 completion tokens, then padding
  width = 30
  seg = np.zeros((2, width), np.int32)
  mask = np.zeros((2, width), np.float32)
  versions = np.full((2, width), -1, np.int32)
  seg[0, :5], mask[0, 2:5], versions[0, 2:5] = 1, 1, [10, 10, 10]  # staleness 0 at version 10
  seg[0, 5:26], mask[0, 6:26], versions[0, 6:26] = 2, 1, 7  # staleness 3
  seg[1, :5], mask[1, 1:5], versions[1, 1:5] = 1, 1, [8, 8, 9, 9]  # staleness 2, 2, 1, 1
  zeroed = np.zeros_like(mask)
  zeroed[0, 3] = 1  # one token of the short sequence (staleness 0)
  zeroed[0, 6:16] = 1  # half of the long one (staleness 3)
  zeroed[1, 1] = 1  # one of the 4-token sequence (staleness 2)
  zeroed[1, 20] = 1  # padding: never counted
  counts = selection_counts(zeroed, mask, versions, seg, version=10)
  m = selection_metrics(counts)
  # lengths: 3 and 4 tokens -> bucket 1..16 (7 tokens, 2 zeroed); 20 -> bucket 17..32 (20, 10)
  assert m["masked_frac_len_1_16"] == pytest.approx(2 / 7)
  assert m["masked_frac_len_17_32"] == pytest.approx(10 / 20)
  # staleness 0: 3 tokens, 1 zeroed; 1: 2, 0; 2: 2, 1; 3 (bucket 3..4): 20, 10
  assert m["masked_frac_stale_0"] == pytest.approx(1 / 3)
  assert m["masked_frac_stale_1"] == 0.0
  assert m["masked_frac_stale_2"] == pytest.approx(1 / 2)
  assert m["masked_frac_stale_3_4"] == pytest.approx(10 / 20)
  assert m["effective_batch"] == pytest.approx(1 - 12 / 27)
  assert not any("len_33" in k or "stale_5" in k for k in m)  # empty buckets are not reported
  # counts add over micro-batches and updates
  twice = selection_metrics(counts + selection_counts(zeroed, mask, versions, seg, version=10))
  assert twice == pytest.approx(m)


def _random_micro_batch(rng, rows=5, width=200):
  """Packed rows of random sequences (prompt, then completion, then padding), random versions,
  random zeroed tokens (some of them off the policy tokens, which never count)."""
  seg = np.zeros((rows, width), np.int32)
  mask = np.zeros((rows, width), np.float32)
  versions = np.full((rows, width), -1, np.int32)
  for r in range(rows):
    at, sid = 0, 1
    while True:
      prompt, completion = int(rng.integers(1, 6)), int(rng.integers(1, 80))
      if at + prompt + completion > width:
        break
      seg[r, at:at + prompt + completion] = sid
      mask[r, at + prompt:at + prompt + completion] = 1
      versions[r, at + prompt:at + prompt + completion] = rng.integers(0, 21, completion)
      at, sid = at + prompt + completion, sid + 1
  zeroed = (rng.random((rows, width)) < 0.3).astype(np.float32)
  return zeroed, mask, versions, seg


def test_the_jitted_count_equals_the_per_token_one():
  """``device_counts`` (in the jitted step, on each token's staleness) against ``selection_counts``
  (numpy, on versions) for random packed micro-batches, every bucket of both kinds reached."""
  rng = np.random.default_rng(3)
  jitted = jax.jit(device_counts)
  seen = set()
  for _ in range(4):
    zeroed, mask, versions, seg = _random_micro_batch(rng)
    want = selection_counts(zeroed, mask, versions, seg, version=20)
    got = counts_of(jax.device_get(jitted(zeroed, mask, np.where(versions >= 0, 20 - versions, -1), seg)))
    assert got == want
    seen |= {bucket for (_, bucket) in want}
  assert {("stale", i) for i in range(6)} <= seen and {("len", i) for i in range(4)} <= seen


def test_an_objective_that_drops_nothing_has_the_whole_batch():
  mask = np.ones((1, 4), np.float32)
  mask[0, 0] = 0
  counts = selection_counts(np.zeros((1, 4)), mask, np.zeros((1, 4), np.int32), np.ones((1, 4), np.int32),
                            version=0)
  assert selection_metrics(counts) == {"masked_frac_len_1_16": 0.0, "masked_frac_stale_0": 0.0,
                                       "effective_batch": 1.0}


@pytest.mark.parametrize("name", ["ppo", "decoupled_ppo", "dis"])
def test_the_per_token_dropped_view_is_what_dropped_frac_counts(name):
  rng = np.random.default_rng(0)
  logp = jnp.asarray(np.log(rng.uniform(0.05, 0.9, (3, 12))), jnp.float32)
  behav = logp + jnp.asarray(rng.normal(0, 0.8, (3, 12)), jnp.float32)
  mask = jnp.asarray(rng.uniform(size=(3, 12)) < 0.8, jnp.float32)
  _, m = losses.policy_loss(name, logp=logp, behav_logp=behav, prox_logp=logp,
                            advantages=jnp.ones((3, 12)), mask=mask, eps_clip=0.2, eps_low=0.3,
                            eps_high=0.5, behav_weight_cap=2.0)
  dropped = np.asarray(m["dropped"])
  assert np.all(dropped[np.asarray(mask) == 0] == 0)
  assert dropped.sum() / float(mask.sum()) == pytest.approx(float(m["dropped_frac"]), abs=1e-6)
  if name != "ppo":
    assert 0 < dropped.sum() < float(mask.sum())  # the inputs make some tokens drop, not all

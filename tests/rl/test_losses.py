"""Losses against hand-computed values and an independent numpy reference (values and gradients)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl_jax.rl import losses

# ----------------------------------------------------------------------------- numpy references


def np_ppo(logp, old, adv, mask, eps):
  """Returns (loss, dloss/dlogp) computed in float64 numpy."""
  r = np.exp(logp - old)
  unclipped, clipped = r * adv, np.clip(r, 1 - eps, 1 + eps) * adv
  per = -np.minimum(unclipped, clipped)
  n = max(mask.sum(), 1.0)
  grad = np.where(unclipped <= clipped, -adv * r, 0.0) * mask / n
  return (per * mask).sum() / n, grad


def np_decoupled(logp, prox, behav, adv, mask, eps, cap=None, floor=None, clip=None):
  w = np.exp(prox - behav)
  if cap is not None:
    w = np.where(w > cap, 0.0, w)
  if floor is not None:
    w = np.where(w < floor, 0.0, w)
  if clip is not None:
    w = np.minimum(w, clip)
  u = np.exp(logp - prox)
  unclipped, clipped = u * adv, np.clip(u, 1 - eps, 1 + eps) * adv
  n = max(mask.sum(), 1.0)
  loss = (-w * np.minimum(unclipped, clipped) * mask).sum() / n
  grad = np.where(unclipped <= clipped, -w * adv * u, 0.0) * mask / n
  return loss, grad


def np_dis(logp, behav, adv, mask, lo, hi):
  rho = np.exp(logp - behav)
  keep = (rho > lo) & (rho < hi) & (mask > 0)
  n = max(mask.sum(), 1.0)
  return (np.where(keep, -rho * adv, 0.0)).sum() / n, np.where(keep, -rho * adv, 0.0) / n


def _random_inputs(seed, shape=(4, 9), spread=0.3):
  rng = np.random.default_rng(seed)
  behav = np.log(rng.uniform(0.05, 0.95, shape))
  prox = behav + rng.normal(0, spread, shape)
  logp = prox + rng.normal(0, spread, shape)
  adv = rng.normal(0, 1, shape)
  mask = (rng.uniform(size=shape) < 0.8).astype(np.float64)
  return logp, prox, behav, adv, mask


def _f32(*xs):
  return [jnp.asarray(x, jnp.float32) for x in xs]


# ----------------------------------------------------------------------------- hand-computed values


def test_naive_ppo_hand_computed():
  old = np.log(np.array([0.2, 0.4, 0.3]))
  logp = np.log(np.array([0.3, 0.2, 0.3]))  # ratios 1.5, 0.5, 1.0
  adv = np.array([1.0, -1.0, 2.0])
  mask = np.ones(3)
  fn = lambda lp: losses.naive_ppo_loss(lp, *_f32(old, adv, mask), eps_clip=0.2)
  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logp, jnp.float32))
  # -min(1.5*1, 1.2*1) = -1.2; -min(-0.5, -0.8) = 0.8; -min(2, 2) = -2  -> mean -0.8
  assert float(loss) == pytest.approx(-0.8, abs=1e-6)
  # Clipped tokens get no gradient; the third gets -A * r / N = -2/3.
  np.testing.assert_allclose(np.asarray(grad), [0.0, 0.0, -2.0 / 3.0], atol=1e-6)
  assert float(metrics["clipped_frac"]) == pytest.approx(2.0 / 3.0)
  assert float(metrics["iw_max"]) == pytest.approx(1.5, rel=1e-6)


def test_decoupled_hand_computed_seed_example():
  # The seed's token: probability 0.2 at generation, 0.25 under prox, 0.3 now.
  behav, prox, logp = (np.log(np.array([p])) for p in (0.2, 0.25, 0.3))
  adv, mask = np.array([1.0]), np.array([1.0])
  loss, metrics = losses.decoupled_ppo_loss(*_f32(logp, prox, behav, adv, mask), eps_clip=0.1)
  # w = 1.25, u = 1.2 clipped to 1.1: L = -1.25 * min(1.2, 1.1) = -1.375
  assert float(loss) == pytest.approx(-1.375, rel=1e-6)
  assert float(metrics["iw_mean"]) == pytest.approx(1.25, rel=1e-6)
  assert float(metrics["clipped_frac"]) == 1.0


def test_dis_hand_computed_seed_bounds():
  behav = np.log(np.array([0.2, 0.2, 0.2]))
  logp = np.log(np.array([0.22, 0.36, 0.13]))  # rho 1.1 (kept), 1.8 (out), 0.65 (out) for (0.7, 1.5)
  adv, mask = np.array([2.0, 1.0, 1.0]), np.ones(3)
  fn = lambda lp: losses.dis_loss(lp, *_f32(behav, adv, mask), eps_low=0.3, eps_high=0.5)[0]
  loss, grad = jax.value_and_grad(fn)(jnp.asarray(logp, jnp.float32))
  assert float(loss) == pytest.approx(-1.1 * 2.0 / 3.0, rel=1e-5)  # dropped tokens stay in N = 3
  np.testing.assert_allclose(np.asarray(grad), [-1.1 * 2.0 / 3.0, 0.0, 0.0], rtol=1e-5)
  _, m = losses.dis_loss(*_f32(logp, behav, adv, mask), eps_low=0.3, eps_high=0.5)
  assert float(m["dropped_frac"]) == pytest.approx(2.0 / 3.0)
  # The paper's math setting (0.7, 6.0) keeps the 1.8 token.
  _, m = losses.dis_loss(*_f32(logp, behav, adv, mask), eps_low=0.3, eps_high=5.0)
  assert float(m["dropped_frac"]) == pytest.approx(1.0 / 3.0)


# ----------------------------------------------------------------------------- numpy reference


@pytest.mark.parametrize("seed", range(4))
def test_naive_ppo_matches_numpy(seed):
  logp, _, behav, adv, mask = _random_inputs(seed)
  fn = lambda lp: losses.naive_ppo_loss(lp, *_f32(behav, adv, mask), eps_clip=0.2)[0]
  loss, grad = jax.value_and_grad(fn)(jnp.asarray(logp, jnp.float32))
  ref_loss, ref_grad = np_ppo(logp, behav, adv, mask, 0.2)
  assert float(loss) == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
  np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("seed,cap", [(0, None), (1, None), (2, 1.3), (3, 1.1)])
def test_decoupled_matches_numpy(seed, cap):
  logp, prox, behav, adv, mask = _random_inputs(seed)
  fn = lambda lp: losses.decoupled_ppo_loss(lp, *_f32(prox, behav, adv, mask), eps_clip=0.2,
                                            behav_weight_cap=cap)[0]
  loss, grad = jax.value_and_grad(fn)(jnp.asarray(logp, jnp.float32))
  ref_loss, ref_grad = np_decoupled(logp, prox, behav, adv, mask, 0.2, cap)
  assert float(loss) == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
  np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-4, atol=1e-6)
  if cap is not None:
    w = np.exp(prox - behav)
    _, m = losses.decoupled_ppo_loss(*_f32(logp, prox, behav, adv, mask), behav_weight_cap=cap)
    assert float(m["dropped_frac"]) == pytest.approx(((w > cap) * mask).sum() / mask.sum(), abs=1e-6)
    assert ((w > cap) * mask).sum() > 0  # the cap really dropped something in this case


@pytest.mark.parametrize("seed", range(4))
def test_dis_matches_numpy(seed):
  logp, _, behav, adv, mask = _random_inputs(seed, spread=0.4)
  fn = lambda lp: losses.dis_loss(lp, *_f32(behav, adv, mask), eps_low=0.2, eps_high=0.3)[0]
  loss, grad = jax.value_and_grad(fn)(jnp.asarray(logp, jnp.float32))
  ref_loss, ref_grad = np_dis(logp, behav, adv, mask, 0.8, 1.3)
  assert float(loss) == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
  np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("cap,floor,clip", [(None, None, None), (5.0, None, None), (None, 0.2, None),
                                            (5.0, 0.2, None), (None, None, 1.0), (5.0, None, 2.0)])
def test_decoupled_matches_numpy_at_stale_inputs(cap, floor, clip):
  """Behaviour far from prox (log-ratios of +-3, weights up to ~e^6 as in the eta 8 probe), logp a
  step away from prox so the clip is active on some tokens: value, gradient and drop count."""
  logp, prox, behav, adv, mask = _random_inputs(7, shape=(6, 16), spread=0.3)
  rng = np.random.default_rng(8)
  behav = prox - rng.normal(0, 2.0, behav.shape)
  w = np.exp(prox - behav)
  assert (w > 5).sum() >= 5 and (w < 0.2).sum() >= 5 and w.max() > 50  # really stale
  fn = lambda lp: losses.decoupled_ppo_loss(lp, *_f32(prox, behav, adv, mask), eps_clip=0.2,
                                            behav_weight_cap=cap, behav_weight_floor=floor,
                                            behav_weight_clip=clip)
  (loss, m), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logp, jnp.float32))
  ref_loss, ref_grad = np_decoupled(logp, prox, behav, adv, mask, 0.2, cap, floor, clip)
  assert float(loss) == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
  np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-4, atol=1e-6)
  dropped = ((w > (cap or np.inf)) | (w < (floor or 0.0))) * mask
  assert float(m["dropped_frac"]) == pytest.approx(dropped.sum() / mask.sum(), abs=1e-6)
  if cap is not None or floor is not None:
    assert dropped.sum() > 0
  if clip is not None:  # truncation keeps every token but none weighs more than the clip
    assert float(m["iw_max"]) <= clip + 1e-6 and float(m["dropped_frac"]) == pytest.approx(
        dropped.sum() / mask.sum(), abs=1e-6)


def test_an_infinite_cap_and_a_zero_floor_drop_nothing():
  logp, prox, behav, adv, mask = _f32(*_random_inputs(9, spread=2.0))
  plain = losses.decoupled_ppo_loss(logp, prox, behav, adv, mask)
  same = losses.decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_weight_cap=float("inf"),
                                   behav_weight_floor=0.0)
  assert float(plain[0]) == float(same[0])
  assert float(same[1]["dropped_frac"]) == 0.0


# ----------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("seed", range(3))
def test_kl_behav_prox_is_the_behaviour_to_proximal_kl_whatever_the_update_did(seed):
  """``kl_behav_prox``: KL(behaviour || proximal) by k3 on the behaviour's samples, from the two
  recorded log-probs alone (so the update's own step, which ``kl_behav`` includes, is not in it)."""
  logp, prox, behav, adv, mask = _random_inputs(seed)
  d = prox - behav
  want = ((np.expm1(d) - d) * mask).sum() / mask.sum()
  for name in ("decoupled_ppo", "ppo_recompute"):
    for moved in (logp, logp + 0.5):  # (the current policy's log-probs do not enter)
      lp, pr, be, ad, ma = _f32(moved, prox, behav, adv, mask)
      _, m = losses.policy_loss(name, logp=lp, behav_logp=be, prox_logp=pr, advantages=ad, mask=ma,
                                eps_clip=0.2, eps_low=0.2, eps_high=0.28)
      assert float(m["kl_behav_prox"]) == pytest.approx(want, rel=1e-4)
      assert float(m["kl_behav"]) != pytest.approx(want, rel=1e-2)  # (control: the other KL differs)
  _, same = losses.decoupled_ppo_loss(*_f32(logp, behav, behav, adv, mask))
  assert float(same["kl_behav_prox"]) == 0.0


@pytest.mark.parametrize("seed", range(3))
def test_decoupled_reduces_exactly_to_ppo_at_staleness_zero(seed):
  logp, _, behav, adv, mask = _random_inputs(seed)
  logp, behav, adv, mask = _f32(logp, behav, adv, mask)
  ppo = jax.value_and_grad(lambda lp: losses.naive_ppo_loss(lp, behav, adv, mask)[0])(logp)
  dec = jax.value_and_grad(lambda lp: losses.decoupled_ppo_loss(lp, behav, behav, adv, mask)[0])(logp)
  assert float(ppo[0]) == float(dec[0])
  np.testing.assert_array_equal(np.asarray(ppo[1]), np.asarray(dec[1]))
  # ... and so does it with the shipped guards (w = 1 is neither dropped nor truncated)
  guarded = jax.value_and_grad(lambda lp: losses.decoupled_ppo_loss(
      lp, behav, behav, adv, mask, behav_weight_cap=5.0, behav_weight_floor=0.2,
      behav_weight_clip=1.0)[0])(logp)
  assert float(ppo[0]) == float(guarded[0])
  np.testing.assert_array_equal(np.asarray(ppo[1]), np.asarray(guarded[1]))


def _exact_log_ratio_for(target):
  """A float32 log-ratio whose jnp.exp is exactly ``target`` (found by stepping through floats)."""
  x = np.float32(math.log(target))
  for _ in range(64):
    got = float(jnp.exp(jnp.float32(x)))
    if got == target:
      return x
    x = np.nextafter(x, np.float32(np.inf if got < target else -np.inf), dtype=np.float32)
  pytest.skip(f"no float32 x with exp(x) == {target} on this platform")


def test_dis_zero_gradient_outside_and_at_strict_boundaries():
  lo, hi = 0.5, 2.0  # exactly representable: eps_low = 0.5, eps_high = 1.0
  log_ratios = np.array([_exact_log_ratio_for(lo), _exact_log_ratio_for(hi), -3.0, 3.0, 0.1, -0.1],
                        np.float32)
  behav = np.zeros(6, np.float32)  # so that logp - behav is exactly the chosen log-ratio
  logp = log_ratios.copy()
  adv = np.array([1.0, -1.0, 1.0, -1.0, 1.0, -1.0], np.float32)
  mask = np.ones(6, np.float32)
  fn = lambda lp: losses.dis_loss(lp, jnp.asarray(behav), jnp.asarray(adv), jnp.asarray(mask),
                                  eps_low=0.5, eps_high=1.0)[0]
  grad = np.asarray(jax.grad(fn)(jnp.asarray(logp)))
  np.testing.assert_array_equal(grad[:4], 0.0)  # both boundaries and both outside: exactly zero
  assert np.all(grad[4:] != 0.0)


def test_dropped_tokens_stay_in_the_denominator():
  logp, prox, behav, adv, mask = _f32(*_random_inputs(5))
  mask = jnp.ones_like(mask)
  prox = prox.at[0, :3].set(behav[0, :3] + 2.0)  # w = e^2 > cap: dropped
  capped, m = losses.decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_weight_cap=3.0)
  keep = mask.at[0, :3].set(0.0)
  manual, _ = losses.decoupled_ppo_loss(logp, prox, behav, adv, keep, normalizer=jnp.sum(mask))
  assert float(capped) == pytest.approx(float(manual), rel=1e-6)
  assert float(m["dropped_frac"]) >= 3 / mask.size


def test_no_nan_or_inf_when_ratios_overflow_or_padding_is_garbage():
  logp = jnp.array([[0.0, -1.0, -2.0, jnp.nan], [-300.0, 0.0, -1e30, jnp.inf]], jnp.float32)
  behav = jnp.array([[-200.0, -1.0, 0.0, jnp.nan], [-1.0, -500.0, 0.0, -jnp.inf]], jnp.float32)
  adv = jnp.array([[-1.0, 1.0, 2.0, jnp.nan], [1.0, -3.0, 1.0, 5.0]], jnp.float32)
  mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 0]], jnp.float32)
  adv = jnp.where(mask > 0, adv, jnp.nan)  # padding advantages are garbage too
  for name in ("ppo", "decoupled_ppo", "dis", "gspo"):
    fn = lambda lp: losses.policy_loss(name, logp=lp, behav_logp=behav, prox_logp=behav - 1.0,
                                       advantages=adv, mask=mask, eps_clip=0.2, eps_low=0.3,
                                       eps_high=5.0, behav_weight_cap=None)
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(logp)
    assert np.isfinite(float(loss)), name
    assert np.all(np.isfinite(np.asarray(grad))), name
    for k, v in metrics.items():
      assert np.all(np.isfinite(np.asarray(v))), (name, k)
    assert np.all(np.asarray(metrics["dropped"])[:, 3] == 0.0), name  # padding is never "dropped"
    assert np.all(np.asarray(grad)[:, 3] == 0.0), name  # padding gets no gradient


def test_empty_mask_gives_zero_loss():
  z = jnp.zeros((2, 3), jnp.float32)
  loss, _ = losses.dis_loss(z, z, z + 1.0, z, eps_low=0.3, eps_high=5.0)
  assert float(loss) == 0.0


def test_unknown_loss_name():
  z = jnp.zeros((1, 2))
  with pytest.raises(ValueError, match="rl.loss='reinforce'"):
    losses.policy_loss("reinforce", logp=z, behav_logp=z, prox_logp=z, advantages=z, mask=z,
                       eps_clip=0.2, eps_low=0.3, eps_high=5.0)
  with pytest.raises(ValueError, match="needs prox_logp"):
    losses.policy_loss("decoupled_ppo", logp=z, behav_logp=z, prox_logp=None, advantages=z, mask=z,
                       eps_clip=0.2, eps_low=0.3, eps_high=5.0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reference_kl_against_numpy_values_and_gradients(estimator):
  """rl.kl_coef's penalty: coef * sum_t c_t k(d_t) / N with d = logp - ref_logp, by hand in float64,
  and its gradient (the reference carries none); padding content never reaches either."""
  logp, ref, _, _, mask = _random_inputs(7)
  weight = np.random.default_rng(8).uniform(0.5, 2.0, logp.shape)
  d = logp - ref
  per = {"k1": d, "k2": 0.5 * d ** 2, "k3": np.exp(-d) - 1 + d}[estimator]
  dper = {"k1": np.ones_like(d), "k2": d, "k3": 1 - np.exp(-d)}[estimator]
  n = 11.0
  want = 0.3 * (per * weight * mask).sum() / n
  garbage = np.where(mask > 0, logp, np.nan)  # (padding: NaN in both inputs)
  lp, rf, ma, wt = _f32(garbage, np.where(mask > 0, ref, np.inf), mask, weight)
  f = lambda x: losses.reference_kl(x, rf, ma, coef=0.3, estimator=estimator, normalizer=n,
                                    loss_weight=wt)[0]
  value, grad = jax.value_and_grad(f)(lp)
  assert float(value) == pytest.approx(want, rel=1e-4)
  np.testing.assert_allclose(np.asarray(grad), 0.3 * dper * weight * mask / n, rtol=1e-4, atol=1e-7)
  _, metrics = losses.reference_kl(lp, rf, ma, coef=0.3, estimator=estimator, normalizer=n)
  assert float(metrics["kl_ref"]) == pytest.approx(((np.exp(-d) - 1 + d) * mask).sum() / mask.sum(), rel=1e-4)
  # the policy at its reference: no penalty, and no gradient but k1's (the score function, whose
  # expectation over the policy's own samples is 0, not each sample's)
  same = jax.value_and_grad(lambda x: losses.reference_kl(x, lp, ma, coef=0.3, estimator=estimator)[0])(lp)
  assert float(same[0]) == 0.0 and np.any(np.asarray(same[1])) == (estimator == "k1")


def test_reference_kl_refuses_an_unknown_estimator():
  with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
    losses.reference_kl(jnp.zeros(2), jnp.zeros(2), jnp.ones(2), coef=1.0, estimator="k4")


# ----------------------------------------------------------------------------- GSPO


def np_gspo(logp, prox, behav, adv, mask, seg, eps_low, eps_high, *, weight=None, cap=None,
            floor=None, clip=None, dual=None, length_normalised=True):
  """GSPO with decoupled PPO's staleness correction, one sequence at a time in float64.

  For sequence i (policy tokens t, n_i of them): s_i = exp(mean_t (logp - prox)), w_i = exp(mean_t
  (prox - behav)) under the guards, A_i = mean_t A_t, L_i = -w_i min(s_i A_i, clip(s_i) A_i).
  Returns (loss, dloss/dlogp, per-sequence records) with loss = sum_i C_i L_i / T, C_i the sequence's
  summed token weights (n_i when ``weight`` is None), T the policy-token count.
  ``length_normalised=False`` (the negative control) takes the product of the token ratios instead.
  """
  c = np.ones_like(mask) if weight is None else weight
  total = max(mask.sum(), 1.0)
  loss, grad, records = 0.0, np.zeros_like(logp), []
  for r in range(seg.shape[0]):
    for sid in sorted(set(seg[r].tolist()) - {0}):
      t = (seg[r] == sid) & (mask[r] > 0)
      if not t.any():
        continue
      n = t.sum()
      log_s = (logp[r, t] - prox[r, t]).sum() / (n if length_normalised else 1)
      s = np.exp(log_s)
      w = np.exp(np.mean(prox[r, t] - behav[r, t]))
      dropped = (cap is not None and w > cap) or (floor is not None and w < floor)
      if dropped:
        w = 0.0
      if clip is not None:
        w = min(w, clip)
      a = np.mean(adv[r, t])
      unclipped, clipped = s * a, np.clip(s, 1 - eps_low, 1 + eps_high) * a
      objective, active = min(unclipped, clipped), clipped < unclipped
      if dual is not None and a < 0 and objective < dual * a:
        objective, active = dual * a, True
      weight_i = c[r, t].sum()
      loss += -w * objective * weight_i / total
      if not active:  # d s_i / d logp_t = s_i / n_i on each policy token of the sequence
        grad[r, t] = -w * a * s / (n if length_normalised else 1) * weight_i / total
      records.append(dict(s=s, w=w, a=a, objective=objective, clipped=active, dropped=dropped, n=n))
  return loss, grad, records


# rows packed with sequences of different lengths, padding (0) at the ends of two rows
GSPO_SEGMENTS = np.array([[1] * 5 + [2] * 7 + [3] * 2 + [0] * 2,
                          [1] * 16,
                          [1] * 3 + [2] * 4 + [3] * 6 + [0] * 3,
                          [1] * 9 + [2] * 7])


def _gspo_inputs(seed, *, tiny=1e-4, spread=0.3, stale=0.5, varying_adv=False):
  """Packed rows (``GSPO_SEGMENTS``) with a prompt (mask 0) at each sequence's start, one sequence
  without any policy token, and NaN wherever the mask is 0. Every other sequence moved by ``tiny``
  per token (its ratio inside the paper's clip), the rest by ``spread`` (outside it); behaviour
  ``stale`` away from prox. Advantages constant along each sequence (group advantages) unless
  ``varying_adv``."""
  rng = np.random.default_rng(seed)
  seg = GSPO_SEGMENTS
  shape = seg.shape
  mask = np.zeros(shape)
  scale = np.zeros(shape)
  adv = np.zeros(shape)
  k = 0
  for r in range(shape[0]):
    for sid in sorted(set(seg[r].tolist()) - {0}):
      where = np.flatnonzero(seg[r] == sid)
      prompt = rng.integers(1, max(len(where) - 1, 2))
      mask[r, where[prompt:]] = rng.uniform(size=len(where) - prompt) < 0.9
      mask[r, where[-1]] = 1.0
      scale[r, where] = tiny if k % 2 else spread
      adv[r, where] = rng.normal(0, 1)
      k += 1
  mask[2, seg[2] == 1] = 0.0  # a sequence of prompt only: no policy token, counted nowhere
  if varying_adv:
    adv = adv + rng.normal(0, 0.5, shape)
  prox = np.log(rng.uniform(0.05, 0.95, shape))
  logp = prox + scale * rng.normal(0, 1, shape)
  behav = prox - rng.normal(0, stale, shape)
  # what the float32 loss sees, so the reference's clip decisions are the same ones
  logp, prox, behav, adv = (np.float32(x).astype(np.float64) for x in (logp, prox, behav, adv))
  return logp, prox, behav, adv, mask, seg


def _garbage(x, mask):
  """NaN on every position the loss must ignore (prompts, padding)."""
  return np.where(mask > 0, x, np.nan)


def _sequence_mean_weights(mask, seg):
  """rl.aggregation='sequence_mean''s c_t = (T / S) / n_i (batching.weight_sequences_equally)."""
  counts = {(r, s): ((seg[r] == s) & (mask[r] > 0)).sum() for r in range(seg.shape[0])
            for s in set(seg[r].tolist()) - {0}}
  live = [n for n in counts.values() if n > 0]
  per_sequence = sum(live) / len(live)
  out = np.ones_like(mask)
  for (r, s), n in counts.items():
    if n:
      out[r, seg[r] == s] = per_sequence / n
  return out


def _gspo(logp, prox, behav, adv, mask, seg, **kw):
  """gspo_loss's value, gradient w.r.t. logp, and metrics, on garbage-padded float32 inputs."""
  p, b, a, m = _f32(_garbage(prox, mask), _garbage(behav, mask), _garbage(adv, mask), mask)
  if kw.get("loss_weight") is not None:
    kw["loss_weight"] = jnp.asarray(kw["loss_weight"], jnp.float32)
  fn = lambda lp: losses.gspo_loss(lp, p, b, a, m, segment_ids=jnp.asarray(seg, jnp.int32), **kw)
  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(
      jnp.asarray(_garbage(logp, mask), jnp.float32))
  return float(loss), np.asarray(grad), metrics


def test_gspo_hand_computed():
  # One row, two packed sequences, no staleness. Sequence 1: token log-ratios 0.1, -0.1 -> s = 1,
  # A = 1. Sequence 2: 0.3, 0.5, 0.4 -> s = e^0.4 = 1.49, clipped to 1.2, A = 2.
  seg = np.array([[1, 1, 2, 2, 2]])
  behav = np.log(np.full((1, 5), 0.3))
  logp = behav + np.array([[0.1, -0.1, 0.3, 0.5, 0.4]])
  adv, mask = np.array([[1.0, 1.0, 2.0, 2.0, 2.0]]), np.ones((1, 5))
  loss, grad, m = _gspo(logp, behav, behav, adv, mask, seg, eps_low=0.2, eps_high=0.2)
  # token mean: (2 * -(1 * 1) + 3 * -(1.2 * 2)) / 5 = -1.84
  assert loss == pytest.approx(-1.84, rel=1e-6)
  # sequence 1's tokens: 2 tokens * (-A * s / n_i) / T = -1 * 1 / 5 each; sequence 2 is clipped
  np.testing.assert_allclose(grad, [[-0.2, -0.2, 0.0, 0.0, 0.0]], rtol=1e-5, atol=1e-7)
  assert float(m["seq_clipped_frac"]) == 0.5 and float(m["clipped_frac"]) == pytest.approx(0.6)
  assert float(m["seq_ratio_mean"]) == pytest.approx((1.0 + math.exp(0.4)) / 2, rel=1e-5)
  assert float(m["seq_iw_mean"]) == 1.0
  # sequence mean (the paper's -mean_i): (-1 - 2.4) / 2
  loss, _, _ = _gspo(logp, behav, behav, adv, mask, seg, eps_low=0.2, eps_high=0.2,
                     loss_weight=_sequence_mean_weights(mask, seg))
  assert loss == pytest.approx(-1.7, rel=1e-6)
  # a stale behaviour policy: w = exp(mean(prox - behav)) = e^0.1 on sequence 1, e^-0.2 on sequence 2
  prox = behav + np.array([[0.0, 0.2, -0.2, -0.2, -0.2]])
  loss, _, m = _gspo(prox + (logp - behav), prox, behav, adv, mask, seg, eps_low=0.2, eps_high=0.2)
  assert loss == pytest.approx((2 * -math.exp(0.1) + 3 * -2.4 * math.exp(-0.2)) / 5, rel=1e-5)
  assert float(m["seq_iw_mean"]) == pytest.approx((math.exp(0.1) + math.exp(-0.2)) / 2, rel=1e-6)


@pytest.mark.parametrize("seed,guards,dual,sequence_mean,varying_adv", [
    (0, {}, None, False, False),
    (1, {}, None, True, False),
    (2, dict(behav_weight_clip=1.0), None, True, False),  # the shipped truncation
    (3, dict(behav_weight_cap=1.15, behav_weight_floor=0.85), None, False, False),
    (6, {}, 1.1, False, True),  # per-token advantages, and the dual clip bounds some sequences
])
def test_gspo_matches_numpy_on_packed_and_padded_rows(seed, guards, dual, sequence_mean, varying_adv):
  """Value and gradient at the paper's clip (3e-4, 4e-4) against the loop above, with NaN on every
  prompt and padding position; the inputs clip some sequences and not others, for both signs."""
  logp, prox, behav, adv, mask, seg = _gspo_inputs(seed, varying_adv=varying_adv)
  weight = _sequence_mean_weights(mask, seg) if sequence_mean else None
  loss, grad, m = _gspo(logp, prox, behav, adv, mask, seg, eps_low=3e-4, eps_high=4e-4,
                        loss_weight=weight, dual_clip=dual, **guards)
  ref, ref_grad, records = np_gspo(
      logp, prox, behav, adv, mask, seg, 3e-4, 4e-4, weight=weight, dual=dual,
      cap=guards.get("behav_weight_cap"), floor=guards.get("behav_weight_floor"),
      clip=guards.get("behav_weight_clip"))
  assert loss == pytest.approx(ref, rel=1e-5, abs=1e-7)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-7)
  clipped = [x["clipped"] for x in records]
  assert any(clipped) and not all(clipped)  # the clip decides, both ways
  assert {np.sign(x["a"]) for x in records if not x["clipped"]} == {-1.0, 1.0}
  counted = [x["clipped"] and not x["dropped"] for x in records]  # (a dropped sequence is not clipped)
  assert float(m["seq_clipped_frac"]) == pytest.approx(np.mean(counted), abs=1e-6)
  assert float(m["seq_dropped_frac"]) == pytest.approx(np.mean([x["dropped"] for x in records]), abs=1e-6)
  assert float(m["seq_ratio_mean"]) == pytest.approx(np.mean([x["s"] for x in records]), rel=1e-5)
  if sequence_mean:  # the paper's form: -(1/S) sum_i w_i min(s_i A_i, clip(s_i) A_i)
    assert loss == pytest.approx(-np.mean([x["w"] * x["objective"] for x in records]), rel=1e-5)
  if "behav_weight_cap" in guards:
    assert 0 < float(m["seq_dropped_frac"]) < 1  # the guards dropped some sequences, not all
  if dual is not None:
    assert any(x["a"] < 0 and x["objective"] == dual * x["a"] for x in records)  # the bound acted
  assert np.all(grad[mask == 0] == 0.0)


def test_gspo_reference_gradient_matches_finite_differences():
  """The reference's analytic gradient, which the loss's is held to, is the derivative of its value."""
  logp, prox, behav, adv, mask, seg = _gspo_inputs(5, varying_adv=True)
  weight = _sequence_mean_weights(mask, seg)
  args = (prox, behav, adv, mask, seg, 3e-4, 4e-4)
  _, grad, records = np_gspo(logp, *args, weight=weight, clip=1.0)
  assert any(not x["clipped"] for x in records)
  h = 1e-7
  for r, t in zip(*np.nonzero(mask)):
    up, down = logp.copy(), logp.copy()
    up[r, t] += h
    down[r, t] -= h
    fd = (np_gspo(up, *args, weight=weight, clip=1.0)[0] - np_gspo(down, *args, weight=weight,
                                                                    clip=1.0)[0]) / (2 * h)
    assert fd == pytest.approx(grad[r, t], rel=1e-4, abs=1e-8), (r, t)


def test_gspo_packed_equals_one_sequence_per_row():
  """The same sequences packed several to a row (segment_ids) or one to a row (padded): the same loss
  and the same gradient on each token; reading a packed row as one sequence is different."""
  logp, prox, behav, adv, mask, seg = _gspo_inputs(6, tiny=0.02, spread=0.1)
  kw = dict(eps_low=0.03, eps_high=0.04, behav_weight_clip=1.0)
  loss, grad, _ = _gspo(logp, prox, behav, adv, mask, seg, **kw)
  spans = [(r, np.flatnonzero(seg[r] == s)) for r in range(seg.shape[0])
           for s in sorted(set(seg[r].tolist()) - {0})]
  width = max(len(where) for _, where in spans)
  rows = [np.zeros((len(spans), width)) for _ in range(5)]
  for i, (r, where) in enumerate(spans):
    for out, x in zip(rows, (logp, prox, behav, adv, mask)):
      out[i, :len(where)] = x[r, where]
  padded_seg = (np.arange(width)[None, :] < np.array([len(w) for _, w in spans])[:, None]).astype(int)
  one_loss, one_grad, _ = _gspo(*rows, padded_seg, **kw)
  assert loss == pytest.approx(one_loss, rel=1e-6)
  for i, (r, where) in enumerate(spans):
    np.testing.assert_allclose(grad[r, where], one_grad[i, :len(where)], rtol=1e-5, atol=1e-8)
  assert abs(loss) > 1e-3
  whole_rows, _, _ = _gspo(logp, prox, behav, adv, mask, (seg > 0).astype(int), **kw)
  assert whole_rows != pytest.approx(loss, rel=1e-3)  # (control: the segment ids matter)


@pytest.mark.parametrize("seed", range(3))
def test_gspo_at_staleness_zero_is_plain_gspo(seed):
  """pi_prox == pi_behav: every w_i = 1, so the loss is plain GSPO (the reference with no weight), and
  the guards on w change nothing, bit for bit; with a stale behaviour policy the weight matters."""
  logp, prox, _, adv, mask, seg = _gspo_inputs(seed)
  plain = _gspo(logp, prox, prox, adv, mask, seg)
  ref, ref_grad, records = np_gspo(logp, prox, prox, adv, mask, seg, 3e-4, 4e-4)
  assert all(x["w"] == 1.0 for x in records)
  assert plain[0] == pytest.approx(ref, rel=1e-5, abs=1e-7)
  np.testing.assert_allclose(plain[1], ref_grad, rtol=1e-4, atol=1e-7)
  guarded = _gspo(logp, prox, prox, adv, mask, seg, behav_weight_cap=5.0, behav_weight_floor=0.2,
                  behav_weight_clip=1.0)
  assert guarded[0] == plain[0]
  np.testing.assert_array_equal(guarded[1], plain[1])
  assert float(plain[2]["seq_iw_mean"]) == 1.0 and float(plain[2]["kl_behav_prox"]) == 0.0
  _, prox_s, behav_s, _, _, _ = _gspo_inputs(seed, stale=0.5)
  stale = _gspo(logp, prox, prox + (behav_s - prox_s), adv, mask, seg)
  assert stale[0] != pytest.approx(plain[0], rel=1e-3)  # (control: the behaviour weight enters)


def test_gspo_negative_controls_token_products_and_token_ratios_differ():
  """The loss is the length-normalised sequence form: the product of the token ratios (no 1 / n_i),
  and decoupled PPO's token-level ratio with the same clip, give other values."""
  logp, prox, behav, adv, mask, seg = _gspo_inputs(7, tiny=0.01, spread=0.05)
  kw = dict(eps_low=0.2, eps_high=0.28)
  loss, grad, _ = _gspo(logp, prox, behav, adv, mask, seg, **kw)
  ref, ref_grad, _ = np_gspo(logp, prox, behav, adv, mask, seg, 0.2, 0.28)
  product, product_grad, _ = np_gspo(logp, prox, behav, adv, mask, seg, 0.2, 0.28,
                                     length_normalised=False)
  assert loss == pytest.approx(ref, rel=1e-5)
  assert loss != pytest.approx(product, rel=1e-2)
  assert np.max(np.abs(grad - product_grad)) > 1e-3
  token, _ = np_decoupled(logp, prox, behav, adv, mask, 0.2)
  assert loss != pytest.approx(token, rel=1e-2)


def test_gspo_through_policy_loss():
  """rl.loss='gspo' dispatches with GSPO's own clip and the segment ids, and needs the prox pass."""
  logp, prox, behav, adv, mask, seg = _gspo_inputs(8)
  lp, pr, be, ad, ma = _f32(logp, prox, behav, adv, mask)
  seg_j = jnp.asarray(seg, jnp.int32)
  got, m = losses.policy_loss("gspo", logp=lp, behav_logp=be, prox_logp=pr, advantages=ad, mask=ma,
                              eps_clip=0.2, eps_low=0.3, eps_high=5.0, behav_weight_clip=1.0,
                              gspo_eps_low=1e-3, gspo_eps_high=2e-3, segment_ids=seg_j)
  want, _ = losses.gspo_loss(lp, pr, be, ad, ma, eps_low=1e-3, eps_high=2e-3, segment_ids=seg_j,
                             behav_weight_clip=1.0)
  assert float(got) == float(want)
  assert set(m) >= {"clipped", "dropped", "clipped_frac", "dropped_frac", "iw_mean", "kl_behav",
                    "kl_prox", "kl_behav_prox", "seq_ratio_mean", "seq_clipped_frac", "seq_iw_mean"}
  assert losses.needs_prox("gspo") and "gspo" in losses.LOSSES
  with pytest.raises(ValueError, match="gspo needs prox_logp"):
    losses.policy_loss("gspo", logp=lp, behav_logp=be, prox_logp=None, advantages=ad, mask=ma,
                       eps_clip=0.2, eps_low=0.3, eps_high=5.0)

"""The seeds' naive baseline (``ppo_recompute``) and the off-policy correction menu, each against an
independent numpy reference (value and gradient), with a check that the inputs exercise the case
(something is truncated, masked or bound), so no test passes vacuously."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl_jax.rl import losses, selection
from asyncrl_jax.rl.losses import Corrections
from tests.rl.test_losses import _f32, _random_inputs, np_decoupled, np_ppo

EPS = 0.2
DEFAULTS = dict(eps_clip=EPS, eps_low=0.3, eps_high=5.0)


def _stale_inputs(seed, shape=(6, 16), spread=1.0):
  """Behaviour far from the current policy (ratios from ~e^-3 to ~e^3), prox between them."""
  logp, prox, behav, adv, mask = _random_inputs(seed, shape=shape, spread=0.3)
  behav = prox - np.random.default_rng(seed + 100).normal(0, spread, shape)
  return logp, prox, behav, adv, mask


def _loss_and_grad(name, logp, prox, behav, adv, mask, corrections=Corrections(), segment_ids=None,
                   **kw):
  prox_j, behav_j, adv_j, mask_j = _f32(prox, behav, adv, mask)

  def fn(lp):
    return losses.policy_loss(name, logp=lp, behav_logp=behav_j, prox_logp=prox_j, advantages=adv_j,
                              mask=mask_j, corrections=corrections, segment_ids=segment_ids,
                              **{**DEFAULTS, **kw})
  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logp, jnp.float32))
  return float(loss), np.asarray(grad), metrics


# ----------------------------------------------------------------------------- ppo_recompute


@pytest.mark.parametrize("seed", range(3))
def test_ppo_recompute_is_ppo_around_the_prox_policy_and_ignores_the_behaviour_one(seed):
  logp, prox, behav, adv, mask = _stale_inputs(seed)
  loss, grad, m = _loss_and_grad("ppo_recompute", logp, prox, behav, adv, mask)
  ref_loss, ref_grad = np_ppo(logp, prox, adv, mask, EPS)
  assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
  # another behaviour policy changes nothing but the metric that measures it
  other = _loss_and_grad("ppo_recompute", logp, prox, behav + 1.0, adv, mask)
  assert other[0] == loss and np.array_equal(other[1], grad)
  assert float(other[2]["kl_behav"]) != pytest.approx(float(m["kl_behav"]))
  # negative control: on these stale inputs PPO on the behaviour ratio is a different objective
  assert _loss_and_grad("ppo", logp, prox, behav, adv, mask)[0] != pytest.approx(loss, rel=1e-3)


@pytest.mark.parametrize("seed", range(3))
def test_ppo_recompute_equals_ppo_exactly_at_staleness_zero(seed):
  logp, _, behav, adv, mask = _random_inputs(seed)
  a = _loss_and_grad("ppo_recompute", logp, behav, behav, adv, mask)
  b = _loss_and_grad("ppo", logp, behav, behav, adv, mask)
  assert a[0] == b[0]
  np.testing.assert_array_equal(a[1], b[1])


# ----------------------------------------------------------------------------- TIS


@pytest.mark.parametrize("ratio", ["current", "prox"])
def test_truncated_is_multiplies_each_token_by_the_capped_ratio(ratio):
  """TIS on the naive baseline (its companion in verl and slime: PPO around the recomputed policy,
  times the capped ratio to the behaviour policy)."""
  logp, prox, behav, adv, mask = _stale_inputs(1)
  cap = 2.0
  loss, grad, m = _loss_and_grad("ppo_recompute", logp, prox, behav, adv, mask,
                                 Corrections(ratio=ratio, tis_cap=cap))
  c = np.minimum(np.exp((logp if ratio == "current" else prox) - behav), cap)
  assert ((c == cap) * mask).sum() >= 5 and ((c < 0.5) * mask).sum() >= 5  # truncated and small ones
  u = np.exp(logp - prox)
  n = mask.sum()
  per = -c * np.minimum(u * adv, np.clip(u, 1 - EPS, 1 + EPS) * adv)
  ref_grad = np.where(u * adv <= np.clip(u, 1 - EPS, 1 + EPS) * adv, -c * adv * u, 0.0) * mask / n
  assert loss == pytest.approx((per * mask).sum() / n, rel=1e-5, abs=1e-6)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
  assert float(m["dropped_frac"]) == 0.0  # truncation drops nothing
  # negative control: without it the loss differs
  assert _loss_and_grad("ppo_recompute", logp, prox, behav, adv, mask)[0] != pytest.approx(loss, rel=1e-3)


@pytest.mark.parametrize("name", ["ppo", "decoupled_ppo", "dis"])
def test_truncated_is_is_refused_where_the_objective_has_the_ratio_already(name):
  with pytest.raises(ValueError, match="tis_cap"):
    _loss_and_grad(name, *_stale_inputs(1), Corrections(tis_cap=2.0))


def test_truncated_is_weight_alone():
  log_ratio = np.log(np.array([[0.5, 1.0, 3.0, 100.0]]))
  mask = np.array([[1.0, 1.0, 1.0, 0.0]])
  np.testing.assert_allclose(np.asarray(losses.truncated_is_weight(*_f32(log_ratio, mask), 2.0)),
                             [[0.5, 1.0, 2.0, 0.0]], rtol=1e-6)


# ----------------------------------------------------------------------------- IcePop


def test_icepop_masks_tokens_outside_the_interval_and_keeps_them_in_the_normaliser():
  logp, prox, behav, adv, mask = _stale_inputs(2)
  low, high = 0.5, 2.0
  loss, grad, m = _loss_and_grad("ppo", logp, prox, behav, adv, mask, Corrections(icepop=(low, high)))
  r = np.exp(logp - behav)
  keep = (r >= low) & (r <= high) & (mask > 0)
  assert 5 <= keep.sum() < mask.sum() - 5  # both sides of the decision are exercised
  ref_loss, ref_grad = np_ppo(logp, behav, adv, mask * keep, EPS)
  n, n_kept = mask.sum(), max((mask * keep).sum(), 1.0)
  assert loss == pytest.approx(ref_loss * n_kept / n, rel=1e-5, abs=1e-6)  # normaliser: all tokens
  np.testing.assert_allclose(grad, ref_grad * n_kept / n, rtol=1e-4, atol=1e-6)
  assert float(m["dropped_frac"]) == pytest.approx(1 - keep.sum() / n, abs=1e-6)


# ----------------------------------------------------------------------------- sequence mask


def test_the_sequence_mask_drops_whole_packed_sequences_by_their_geometric_mean_ratio():
  rng = np.random.default_rng(3)
  shape = (3, 12)
  segment_ids = np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12, [1] * 3 + [2] * 3 + [3] * 6])
  mask = (segment_ids > 0) * (rng.uniform(size=shape) < 0.85)
  behav = np.log(rng.uniform(0.1, 0.9, shape))
  shift = {(0, 1): 0.1, (0, 2): 1.5, (1, 1): -0.05, (2, 1): -1.2, (2, 2): 0.3, (2, 3): 0.0}
  logp = behav + np.array([[shift.get((r, s), 0.0) for s in row] for r, row in enumerate(segment_ids)])
  logp = logp + rng.normal(0, 0.2, shape)  # token-level noise around each sequence's drift
  adv = rng.normal(0, 1, shape)
  low, high = 0.6, 1.6
  seg = jnp.asarray(segment_ids, jnp.int32)
  loss, grad, m = _loss_and_grad("ppo", logp, behav, behav, adv, mask, Corrections(seq_mask=(low, high)),
                                 segment_ids=seg)
  keep = np.zeros(shape, bool)
  for r in range(shape[0]):
    for s in set(segment_ids[r]) - {0}:
      where = (segment_ids[r] == s) & (mask[r] > 0)
      g = np.exp(np.mean((logp - behav)[r][where]))
      keep[r] |= (segment_ids[r] == s) & (low <= g <= high)
  assert keep.sum() > 0 and (mask * ~keep).sum() > 0  # some sequences kept, some dropped
  ref_loss, ref_grad = np_ppo(logp, behav, adv, mask * keep, EPS)
  n, n_kept = mask.sum(), (mask * keep).sum()
  assert loss == pytest.approx(ref_loss * n_kept / n, rel=1e-5, abs=1e-6)
  np.testing.assert_allclose(grad, ref_grad * n_kept / n, rtol=1e-4, atol=1e-6)
  # negative control: a mask that reads every row as one sequence decides differently
  wrong = _loss_and_grad("ppo", logp, behav, behav, adv, mask, Corrections(seq_mask=(low, high)),
                         segment_ids=jnp.asarray((segment_ids > 0).astype(np.int32)))
  assert wrong[0] != pytest.approx(loss, rel=1e-3)


# ----------------------------------------------------------------------------- dual clip


def np_dual_clip(logp, old, adv, mask, eps, c):
  r = np.exp(logp - old)
  unclipped, clipped = r * adv, np.clip(r, 1 - eps, 1 + eps) * adv
  obj = np.minimum(unclipped, clipped)
  bound = (adv < 0) & (obj < c * adv)
  obj = np.where(bound, c * adv, obj)
  n = max(mask.sum(), 1.0)
  grad = np.where((unclipped <= clipped) & ~bound, -adv * r, 0.0) * mask / n
  return (-obj * mask).sum() / n, grad, bound


@pytest.mark.parametrize("name", ["ppo", "ppo_recompute"])
def test_dual_clip_bounds_the_push_of_negative_advantages(name):
  logp, prox, behav, adv, mask = _stale_inputs(4, spread=1.5)
  c = 3.0
  old = behav if name == "ppo" else prox - 1.5  # (prox far below logp, so the bound is reached)
  loss, grad, m = _loss_and_grad(name, logp, old if name == "ppo_recompute" else prox, behav, adv, mask,
                                 Corrections(dual_clip=c))
  ref_loss, ref_grad, bound = np_dual_clip(logp, old, adv, mask, EPS, c)
  assert (bound * mask).sum() >= 3  # the bound is active on some tokens
  assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
  plain = _loss_and_grad(name, logp, old if name == "ppo_recompute" else prox, behav, adv, mask)
  assert plain[0] > loss  # without the bound those tokens push harder (a larger loss to descend)


def test_dual_clip_on_decoupled_ppo_bounds_u_and_keeps_the_behaviour_weight():
  logp, prox, behav, adv, mask = _stale_inputs(5, spread=0.5)
  prox = logp - 1.5  # u = e^1.5 > 3 everywhere
  c = 3.0
  loss, grad, _ = _loss_and_grad("decoupled_ppo", logp, prox, behav, adv, mask, Corrections(dual_clip=c))
  w = np.exp(prox - behav)
  obj_loss, obj_grad, bound = np_dual_clip(logp, prox, adv, mask, EPS, c)
  assert (bound * mask).sum() >= 3
  n = mask.sum()
  u = np.exp(logp - prox)
  obj = np.where(bound, c * adv, np.minimum(u * adv, np.clip(u, 1 - EPS, 1 + EPS) * adv))
  assert loss == pytest.approx((-w * obj * mask).sum() / n, rel=1e-5, abs=1e-6)
  np.testing.assert_allclose(grad, w * obj_grad, rtol=1e-4, atol=1e-6)
  ref_plain, _ = np_decoupled(logp, prox, behav, adv, mask, EPS)
  assert ref_plain != pytest.approx(loss, rel=1e-3)


def test_dual_clip_with_dis_is_refused():
  with pytest.raises(ValueError, match="dual_clip"):
    _loss_and_grad("dis", *_random_inputs(0), Corrections(dual_clip=3.0))


# ----------------------------------------------------------------------------- sign-aware DIS


def test_sign_aware_dis_keeps_the_tokens_that_drifted_against_their_advantage():
  logp, prox, behav, adv, mask = _stale_inputs(6)
  lo, hi = 0.7, 2.0
  kw = dict(eps_low=1 - lo, eps_high=hi - 1)
  loss, grad, m = _loss_and_grad("dis", logp, prox, behav, adv, mask, dis_sign_aware=True, **kw)
  rho = np.exp(logp - behav)
  agrees = ((rho >= hi) & (adv > 0)) | ((rho <= lo) & (adv < 0))
  keep = ~agrees & (mask > 0)
  against = ((rho >= hi) & (adv < 0)) | ((rho <= lo) & (adv > 0))
  assert (against * mask).sum() >= 5 and (agrees * mask).sum() >= 5  # both kinds are present
  n = mask.sum()
  assert loss == pytest.approx(np.where(keep, -rho * adv, 0.0).sum() / n, rel=1e-5, abs=1e-6)
  np.testing.assert_allclose(grad, np.where(keep, -rho * adv, 0.0) / n, rtol=1e-4, atol=1e-6)
  assert float(m["dropped_frac"]) == pytest.approx((agrees * mask).sum() / n, abs=1e-6)
  # the plain interval mask drops the "against" tokens too
  _, plain_grad, plain = _loss_and_grad("dis", logp, prox, behav, adv, mask, **kw)
  assert float(plain["dropped_frac"]) > float(m["dropped_frac"])
  assert np.all(plain_grad[(against * mask) > 0] == 0) and np.all(grad[(against * mask) > 0] != 0)


# ----------------------------------------------------------------------------- metrics


def test_ratio_quantiles_and_sides_match_numpy():
  logp, prox, behav, adv, mask = _stale_inputs(7, shape=(8, 32))
  dropped = (np.random.default_rng(1).uniform(size=mask.shape) < 0.3) * mask
  clipped = (np.random.default_rng(2).uniform(size=mask.shape) < 0.2) * mask * (1 - dropped)
  log_ratio = logp - behav
  counts = selection.counts_of(jax.device_get(selection.device_counts(
      *_f32(dropped, mask), jnp.zeros(mask.shape, jnp.int32), jnp.ones(mask.shape, jnp.int32),
      log_ratio=jnp.asarray(log_ratio, jnp.float32), advantages=jnp.asarray(adv, jnp.float32),
      clipped=jnp.asarray(clipped, jnp.float32))))
  metrics = selection.selection_metrics(counts)
  r = np.exp(log_ratio[mask > 0])
  for q in (50, 90, 99):  # within one bin (RATIO_BIN nats) above the exact quantile
    exact = np.quantile(r, q / 100, method="inverted_cdf")
    assert exact <= metrics[f"ratio_p{q}"] * (1 + 1e-5)
    assert metrics[f"ratio_p{q}"] <= exact * np.exp(selection.RATIO_BIN) * (1 + 1e-5)
  n = mask.sum()
  hi, neg = log_ratio > 0, adv < 0
  for name, where in (("hi_pos", hi & ~neg), ("hi_neg", hi & neg), ("lo_pos", ~hi & ~neg),
                      ("lo_neg", ~hi & neg)):
    assert metrics[f"masked_frac_{name}"] == pytest.approx((dropped * where).sum() / n)
    assert metrics[f"clipped_frac_{name}"] == pytest.approx((clipped * where).sum() / n)
    assert (mask * where).sum() > 0
  assert sum(metrics[f"masked_frac_{s}"] for s in selection.SIDES) == pytest.approx(dropped.sum() / n)

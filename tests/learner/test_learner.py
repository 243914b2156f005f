"""The Learner's update against a reference written out step by step (prox pass, summed micro-batch
gradients, optax update) on unsharded parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.fixtures.helpers import max_abs_diff, random_sequences, sharp_params
from asyncrl_jax import config as config_lib, models
from asyncrl_jax.infra import sharding
from asyncrl_jax.learner.learner import Learner, make_optimizer
from asyncrl_jax.rl import batching
from asyncrl_jax.rl.logprobs import compute_logprobs
from asyncrl_jax.rl.objective import LossSettings, micro_batch_loss
from asyncrl_jax.rl.staleness import VersionMismatch

CFG = models.ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=128)
TOKEN_BUDGET = 128


def _sequences(seed, n=12):
  return random_sequences(seed, n, CFG.vocab_size)


def _config(loss, minibatches):
  c = config_lib.base_config()
  c.rl.loss = loss
  c.rl.eps_clip = 0.1
  c.rl.behav_weight_cap = 8.0  # drops some tokens (behaviour probabilities are low)
  c.learner.ppo_minibatches = minibatches
  c.learner.token_budget = TOKEN_BUDGET
  c.learner.learning_rate = 3e-2
  c.learner.grad_clip = 1e6
  return c


def _reference(params, sequences, config, prox_after_update=False, *, start=None, opt_state=None,
               with_state=False):
  """One policy version written out by hand. ``prox_after_update`` is a deliberately wrong variant
  (each minibatch's prox pass under the weights it is updated from) used to show the test can tell.
  ``start``: the KL reference's weights (rl.kl_coef); ``opt_state``: the optimizer's state to go on
  from (``with_state`` returns it too)."""
  settings = LossSettings.from_config(config)
  optimizer = make_optimizer(config, config.steps)
  opt_state = optimizer.init(params) if opt_state is None else opt_state
  chunks = np.array_split(np.arange(len(sequences)), config.learner.ppo_minibatches)
  plans = [batching.pack_sequences([sequences[i] for i in idx], TOKEN_BUDGET) for idx in chunks]
  before = params

  def prox_of(p, b):
    return compute_logprobs(CFG, p, b.tokens, b.positions, b.segment_ids)

  prox = [[prox_of(before, jax.tree.map(jnp.asarray, b)) for b in mbs] for mbs in plans]
  for mbs, prox_mbs in zip(plans, prox):
    normalizer = batching.total_policy_tokens(mbs)
    grads = None
    for b, p in zip(mbs, prox_mbs):
      b = jax.tree.map(jnp.asarray, b)
      if prox_after_update:
        p = prox_of(params, b)
      ref = prox_of(start, b) if start is not None else None
      g = jax.grad(lambda w, b=b, p=p, ref=ref: micro_batch_loss(w, b, p, normalizer, model=CFG,
                                                                 settings=settings, ref_logp=ref)[0])(params)
      grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return (params, opt_state) if with_state else params



@pytest.mark.slow(123)
@pytest.mark.parametrize("loss,minibatches", [("decoupled_ppo", 1), ("decoupled_ppo", 2), ("dis", 2),
                                              ("ppo", 1)])
def test_learner_update_equals_written_out_reference(loss, minibatches):
  config = _config(loss, minibatches)
  params = sharp_params(CFG, 4, scale=2.0)
  sequences = _sequences(5)
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  learner = Learner(CFG, params, mesh, config, versions=config.steps)
  metrics = learner.train(sequences, version=0)
  assert metrics["micro_batches"] > minibatches  # several micro-batches per update are summed
  # the selection monitor counts the same zeroed tokens as the loss's token-weighted dropped_frac
  # (every token here is fresh: staleness 0)
  assert metrics["effective_batch"] == pytest.approx(1 - metrics["dropped_frac"], abs=1e-5)
  assert metrics["masked_frac_stale_0"] == pytest.approx(metrics["dropped_frac"], abs=1e-5)
  assert (metrics["dropped_frac"] > 0) == (loss == "dis")  # (DIS masks some tokens of these inputs)
  want = _reference(params, sequences, config)
  moved = max_abs_diff(want, params)
  assert moved > 1e-2  # the update is large enough to compare
  # Adam's first steps divide by |g|: coordinates with gradients near zero amplify float noise, hence
  # a tolerance relative to the size of the update.
  tolerance = 2e-2 * moved
  assert max_abs_diff(learner.params, want) < tolerance
  if loss == "decoupled_ppo" and minibatches > 1:
    # The second minibatch's prox must be the weights *before* the first update: the wrong variant
    # differs by far more than the tolerance above.
    wrong = _reference(params, sequences, config, prox_after_update=True)
    assert max_abs_diff(wrong, want) > 10 * tolerance


@pytest.mark.slow(60)
def test_the_kl_term_pulls_towards_the_policy_the_run_started_from():
  """rl.kl_coef: the learner's reference is its starting weights (the penalty is 0 there); with the
  reference set to other weights, one version equals the version written out by hand with the
  penalty towards them, and a large coefficient ends nearer them than none (the control: without the
  term the learner ends elsewhere)."""
  config = _config("decoupled_ppo", 2)
  config.rl.kl_coef = 0.5
  params = sharp_params(CFG, 4, scale=2.0)
  start = sharp_params(CFG, 9, scale=2.0)
  sequences = _sequences(5)
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})

  def learner_with(coef, reference=None):
    c = _config("decoupled_ppo", 2)
    c.rl.kl_coef = coef
    learner = Learner(CFG, params, mesh, c, versions=c.steps)
    assert (learner.reference is None) == (coef == 0)
    if reference is not None:
      learner.reference = jax.device_put(reference, learner.param_shardings)
    return learner

  fresh = learner_with(0.5)
  assert max_abs_diff(fresh.reference, params) == 0.0
  mbs, normalizer = fresh.updater.place(sequences)
  ref = [fresh._prox(fresh.reference_params(), b) for b in mbs]  # pylint: disable=protected-access
  per_mb, _ = fresh.updater.update(mbs, normalizer, loss="first", aux=fresh._aux(None, ref))  # pylint: disable=protected-access
  assert all(float(m["kl_ref"]) == 0.0 for m in per_mb)  # (the first update starts at the reference)

  learner = learner_with(0.5, start)
  metrics = learner.train(sequences, version=0)
  assert metrics["kl_ref"] > 0 and metrics["kl_ref_penalty"] > 0
  assert max_abs_diff(learner.reference, start) == 0.0  # (the reference does not move)
  want = _reference(params, sequences, config, start=start)
  moved = max_abs_diff(want, params)
  tolerance = 2e-2 * moved
  assert max_abs_diff(learner.params, want) < tolerance
  free, held = learner_with(0.0), learner_with(50.0, start)
  for other in (free, held):
    other.train(sequences, version=0)
  assert max_abs_diff(free.params, want) > 10 * tolerance
  assert max_abs_diff(held.params, start) < max_abs_diff(free.params, start)


@pytest.mark.slow(23)
def test_selection_monitor_buckets_tokens_by_their_staleness():
  """Trained at version 3 on tokens sampled at versions 3, 2 and 1. The behaviour log-probs equal the
  current policy's except on the version-1 tokens, where they are 1 nat too high (ratio e^-1, below
  DIS's 1 - eps_low = 0.7), so DIS masks exactly the tokens of staleness 2. Raw versions, or a
  staleness of the wrong sign, would put the masked tokens in another bucket."""
  config = _config("dis", 1)
  params = sharp_params(CFG, 4, scale=2.0)
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  sequences = []
  for i, s in enumerate(_sequences(7, n=12)):
    n = len(s.tokens)
    current = np.asarray(compute_logprobs(CFG, params, s.tokens[None], np.arange(n)[None],
                                          np.ones((1, n), np.int32)))[0]
    sampled_at = 3 - i % 3  # staleness 0, 1, 2 in turn
    behav = current + (1.0 if sampled_at == 1 else 0.0)
    sequences.append(s._replace(behav_logp=np.where(s.mask > 0, behav, 0).astype(np.float32),
                                versions=np.where(s.mask > 0, sampled_at, -1).astype(np.int32)))
  learner = Learner(CFG, params, mesh, config, versions=config.steps)
  learner.version = 3
  metrics = learner.train(sequences, version=3)
  stale = {k: v for k, v in metrics.items() if k.startswith("masked_frac_stale")}
  assert stale == {"masked_frac_stale_0": pytest.approx(0.0, abs=1e-6),
                   "masked_frac_stale_1": pytest.approx(0.0, abs=1e-6),
                   "masked_frac_stale_2": pytest.approx(1.0)}
  policy = np.array([float(np.sum(s.mask)) for s in sequences])
  want_dropped = policy[2::3].sum() / policy.sum()  # the version-1 tokens' share of all policy tokens
  assert metrics["dropped_frac"] == pytest.approx(want_dropped, abs=1e-5)
  assert metrics["effective_batch"] == pytest.approx(1 - want_dropped, abs=1e-5)


def test_prox_is_current_refuses_a_prox_argument():
  b = jax.tree.map(jnp.asarray, batching.pack_sequences(_sequences(1, 2), TOKEN_BUDGET)[0])
  params = sharp_params(CFG, 0)
  with pytest.raises(ValueError, match="prox_is_current"):
    micro_batch_loss(params, b, jnp.zeros(b.tokens.shape), 1.0, model=CFG, settings=LossSettings(),
                     prox_is_current=True)


@pytest.mark.slow(18)
def test_update_steps_trace_once_per_micro_batch_shape():
  """The train step is bounded by the shapes packing allows: row buckets 32 and 64 under a 64-token
  budget. Both run; a micro-batch of another shape (what a bypassed bucketing would produce) trips it."""
  from asyncrl_jax.learner import updater as update  # pylint: disable=import-outside-toplevel
  config = _config("ppo", 1)
  config.learner.token_budget = 64
  cfg = CFG.replace(max_seq_len=64)
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  learner = Learner(cfg, sharp_params(cfg, 0), mesh, config, versions=4)
  assert update.micro_batch_shapes(64, 64) == 2
  short = [s for s in _sequences(1, 24) if len(s.tokens) <= 32][:4]
  long = [s for s in _sequences(2, 24) if 32 < len(s.tokens) <= 64][:2]
  learner.train(short, version=0)  # rows of 32
  learner.train(long, version=1)  # rows of 64
  learner.train(short + long, version=2)  # rows of 64 again: no new trace
  odd = jax.device_put(batching.layout_rows(short, [[0]], 2, 48), learner.updater.batch_sharding)
  with pytest.raises(AssertionError, match="traced > 2 times"):
    learner.updater.update([odd], jnp.float32(1.0), loss="first")
  with pytest.raises(VersionMismatch, match="for policy version 2, but the learner is at version 3"):
    learner.train(short, version=2)


@pytest.mark.slow(43)
def test_warm_up_compiles_every_micro_batch_shape_and_changes_nothing():
  """After ``warm_up`` (row buckets 32 and 64 under a 64-token budget), parameters and optimizer
  state are unchanged bit for bit, and training on both shapes, with a prox pass, compiles nothing."""
  from asyncrl_jax.train import runlog  # pylint: disable=import-outside-toplevel
  config = _config("decoupled_ppo", 2)
  config.learner.token_budget = 64
  cfg = CFG.replace(max_seq_len=64)
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  learner = Learner(cfg, sharp_params(cfg, 0), mesh, config, versions=4)
  before = jax.device_get((learner.params, learner.opt_state))
  runlog.process_memory()  # (starts counting compilations)
  assert learner.warm_up(64) == 2
  after = jax.device_get((learner.params, learner.opt_state))
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
  assert learner.version == 0
  compiled = runlog.process_memory()["xla_compiles"]
  assert compiled > 0
  short = [s for s in _sequences(1, 24) if len(s.tokens) <= 32][:4]
  long = [s for s in _sequences(2, 24) if 32 < len(s.tokens) <= 64][:2]
  learner.train(short, version=0)
  learner.train(long, version=1)
  assert runlog.process_memory()["xla_compiles"] == compiled


@pytest.mark.slow(42)
@pytest.mark.parametrize("poison", ["advantage"])  # (a NaN behaviour log-prob acts the same way)
def test_a_non_finite_update_is_not_applied_and_names_the_version_and_the_figure(poison):
  """A NaN in one sequence's advantages (or behaviour log-prob) makes the loss and gradients
  NaN: the step is refused inside the jitted update (params and optimizer state unchanged, bit for
  bit), the version is not counted, and the error names the version and what was not finite. The next
  good batch trains normally."""
  from asyncrl_jax.learner.learner import NonFiniteError  # pylint: disable=import-outside-toplevel
  config = _config("decoupled_ppo", 2)
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  learner = Learner(CFG, sharp_params(CFG, 4, scale=2.0), mesh, config, versions=4)
  learner.train(_sequences(1), version=0)
  before = jax.device_get((learner.params, learner.opt_state))
  bad = _sequences(2)  # (the first minibatch holds sequence 0: its step and the next are refused)
  if poison == "advantage":
    bad[0].advantages[:] = np.nan
  else:
    bad[0].behav_logp[np.flatnonzero(bad[0].mask)[0]] = np.nan
  with pytest.raises(NonFiniteError, match=r"policy version 1: non-finite .*2 of 2 optimizer steps "
                                           r"of this version were not applied"):
    learner.train(bad, version=1)
  assert learner.version == 1
  after = jax.device_get((learner.params, learner.opt_state))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)
  metrics = learner.train(_sequences(3), version=1)
  assert learner.version == 2 and np.isfinite(metrics["loss"])
  assert max_abs_diff(learner.params, before[0]) > 0


@pytest.mark.slow(41)
def test_the_learning_rate_schedule_counts_optimizer_updates_not_versions():
  """8 versions of 4 minibatches are 32 optimizer updates: the cosine runs over all of them, from the
  peak at update 0 to the floor (10%) at update 31, the last update of the last version. Counting
  versions instead (the schedule over 8 steps) would reach the floor after version 2."""
  config = _config("decoupled_ppo", 4)
  config.learner.learning_rate = 1e-3
  versions, minibatches = 8, 4
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  learner = Learner(CFG, sharp_params(CFG, 4, scale=2.0), mesh, config, versions=versions)
  updates = versions * minibatches
  peak, floor = 1e-3, 1e-4
  for v in range(versions):
    m = learner.train(_sequences(v), version=v)
    last = (v + 1) * minibatches - 1  # the version's last update, by hand
    want = floor + (peak - floor) * 0.5 * (1 + np.cos(np.pi * last / (updates - 1)))
    assert m["optimizer_steps"] == last + 1
    assert m["learning_rate"] == pytest.approx(want, rel=1e-5), v
    if v + 1 == versions // 2:  # half way through the run: above half the peak
      assert m["learning_rate"] > peak / 2
    if v + 1 < versions:  # not at the floor before the last version
      assert m["learning_rate"] > floor * 1.05
  assert m["learning_rate"] == pytest.approx(floor, rel=1e-6)


@pytest.mark.slow(34)
@pytest.mark.parametrize("freeze_attention", [False, True])
def test_adamw_moments_are_sharded_like_the_parameters(freeze_attention):
  """On an FSDP mesh each device holds 1/N of every parameter and of AdamW's two moments; left to jit,
  moments made from zeros came out replicated (N times the memory). The critic's masked optimizer
  (frozen attention) too; a version trains without moving them."""
  mesh = sharding.make_mesh(jax.devices()[:4], dict(data=1, fsdp=4, tensor=1))
  config = _config("decoupled_ppo", 1)
  config.rl.advantage = "value"
  config.rl.value_freeze_attention = freeze_attention
  learner = Learner(CFG, models.init_params(CFG, jax.random.key(0)), mesh, config, versions=2)
  for updater in (learner.updater, learner.critic.updater):
    moments = [s for s in jax.tree.leaves(updater.opt_state, is_leaf=lambda x: isinstance(
        x, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
    assert moments
    params = updater.params
    by_shape = {}
    for p in jax.tree.leaves(params):
      by_shape.setdefault(p.shape, []).append(p.sharding)
    for state in moments:  # (a frozen subtree's moments are absent: optax.MaskedNode)
      for m in jax.tree.leaves(state.mu) + jax.tree.leaves(state.nu):
        assert any(m.sharding.is_equivalent_to(s, m.ndim) for s in by_shape[m.shape]), m.sharding
    embed = params["embed"] if "embed" in params else params["trunk"]["embed"]
    assert embed.addressable_shards[0].data.size == embed.size // 4  # negative control: split
  before = jax.tree.map(lambda x: x.sharding, learner.opt_state)
  learner.train(_sequences(0), version=0)
  assert jax.tree.map(lambda x: x.sharding, learner.opt_state) == before

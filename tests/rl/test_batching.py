"""Packing invariants, packed arrays, the prox log-prob pass, and packed == padded loss and gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fixtures.helpers import max_abs_diff, sharp_params
from asyncrl_jax import models
from asyncrl_jax.rl import batching
from asyncrl_jax.rl.logprobs import compute_logprobs
from asyncrl_jax.rl.objective import LossSettings, micro_batch_loss


def test_pack_hand_example():
  # FFD: 7 -> bin0 (3 left), 5 -> bin1 (5 left), 4 -> bin1 (1 left), 3 -> bin0 (0), 2 -> bin2, 1 -> bin1
  assert batching.pack([3, 7, 2, 5, 4, 1], 10) == [[1, 0], [3, 4, 5], [2]]


@pytest.mark.parametrize("seed", range(5))
def test_pack_invariants(seed):
  rng = np.random.default_rng(seed)
  lengths = np.minimum(rng.lognormal(3.0, 1.0, size=200).astype(int) + 1, 256)
  bins = batching.pack(lengths, 256)
  flat = sorted(i for b in bins for i in b)
  assert flat == list(range(200))  # every index exactly once
  assert all(sum(lengths[i] for i in b) <= 256 for b in bins)
  assert len(bins) <= 11 / 9 * (lengths.sum() / 256) + 1  # FFD's classical bound vs the optimum


def test_pack_errors():
  with pytest.raises(batching.PackingError, match="sequence 1 has 300 tokens, more than the token budget 256"):
    batching.pack([10, 300], 256)
  with pytest.raises(batching.PackingError, match="sequence 0 has length 0"):
    batching.pack([0], 256)


def _sequence(rng, prompt_len, completion_len, vocab):
  n = prompt_len + completion_len
  mask = np.r_[np.zeros(prompt_len), np.ones(completion_len)].astype(np.float32)
  return batching.SequenceData(
      tokens=rng.integers(3, vocab, size=n).astype(np.int32), mask=mask,
      behav_logp=np.where(mask > 0, np.log(rng.uniform(0.05, 0.9, n)), 0).astype(np.float32),
      advantages=np.where(mask > 0, rng.normal(), 0).astype(np.float32),
      versions=np.where(mask > 0, rng.integers(0, 3), -1).astype(np.int32))


def test_layout_segments_and_positions():
  rng = np.random.default_rng(0)
  seqs = [_sequence(rng, 3, n, 17) for n in (20, 5, 60, 9, 1)]
  plan = batching.plan_micro_batches([len(s.tokens) for s in seqs], 128)
  assert plan.row_len == 64 and plan.rows == 2
  batches = batching.layout(seqs, plan)
  assert all(b.tokens.shape == (2, 64) for b in batches)
  seen = []
  for b in batches:
    for r in range(2):
      for seg in range(1, b.segment_ids[r].max() + 1):
        idx = np.where(b.segment_ids[r] == seg)[0]
        assert np.all(np.diff(idx) == 1) and np.array_equal(b.positions[r, idx], np.arange(len(idx)))
        seen.append(b.tokens[r, idx].tolist())
  assert sorted(seen) == sorted(s.tokens.tolist() for s in seqs)
  assert batching.total_policy_tokens(batches) == sum(s.mask.sum() for s in seqs)
  bad = seqs[0]._replace(mask=np.ones(len(seqs[0].tokens), np.float32))
  with pytest.raises(batching.PackingError, match="first token has no context"):
    batching.layout_rows([bad], [[0]], 1, 64)


CFG = models.ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=128)


@pytest.fixture(scope="module")
def params():
  return sharp_params(CFG, 1)


def test_prox_logprobs_equal_log_softmax_of_full_forward(params):
  rng = np.random.default_rng(2)
  seqs = [_sequence(rng, 4, n, CFG.vocab_size) for n in (10, 30, 3)]
  (batch,) = batching.pack_sequences(seqs, 256, row_len=64)
  logp = np.asarray(compute_logprobs(CFG, params, batch.tokens, batch.positions, batch.segment_ids,
                                     temperature=0.7))
  for s in seqs:  # independent path: each sequence alone, numpy log-softmax
    logits = np.asarray(models.logits(CFG, params, s.tokens[None]))[0].astype(np.float64) / 0.7
    lsm = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want = np.r_[0.0, lsm[np.arange(len(s.tokens) - 1), s.tokens[1:]]]
    found = False
    for r in range(batch.tokens.shape[0]):
      for seg in range(1, batch.segment_ids[r].max() + 1):
        idx = np.where(batch.segment_ids[r] == seg)[0]
        if len(idx) == len(s.tokens) and np.array_equal(batch.tokens[r, idx], s.tokens):
          np.testing.assert_allclose(logp[r, idx], want, atol=2e-5)
          found = True
    assert found
  assert np.all(logp[batch.segment_ids == 0] == 0.0)


@pytest.mark.slow(41)
@pytest.mark.parametrize("loss", ["ppo", "decoupled_ppo", "dis", "gspo"])
def test_packed_micro_batches_equal_padded_batch(params, loss):
  rng = np.random.default_rng(3)
  lengths = np.minimum(rng.lognormal(2.5, 0.8, size=12).astype(int) + 2, 60)
  seqs = [_sequence(rng, 3, int(n), CFG.vocab_size) for n in lengths]
  # Behaviour log-probs near the current policy's, so that DIS keeps most tokens and drops some.
  behav_params = jax.tree.map(lambda x: x * 0.95, params)
  rows = batching.layout_rows(seqs, [[i] for i in range(len(seqs))], len(seqs), 64)  # one per row
  behav = np.asarray(compute_logprobs(CFG, behav_params, rows.tokens, rows.positions, rows.segment_ids))
  seqs = [s._replace(behav_logp=np.where(
      s.mask > 0, behav[i, :len(s.tokens)] + rng.normal(0, 0.2, len(s.tokens)), 0).astype(np.float32))
          for i, s in enumerate(seqs)]
  # (GSPO's clip widened from the paper's 3e-4 so that some sequences keep their gradient)
  settings = LossSettings(loss=loss, eps_clip=0.2, eps_low=0.3, eps_high=0.5, behav_weight_cap=2.0,
                          gspo_eps_low=0.02, gspo_eps_high=0.03, temperature=1.0)
  # Perturbed params stand in for the "before the update" weights of the prox pass.
  prox_params = jax.tree.map(lambda x: x * 0.97, params)

  @jax.jit
  def value_and_grad(p, b, prox, normalizer):
    return jax.value_and_grad(
        lambda q: micro_batch_loss(q, b, prox, normalizer, model=CFG, settings=settings)[0])(p)

  def loss_and_grad(batches):
    normalizer = batching.total_policy_tokens(batches)
    total, grads = 0.0, None
    for b in batches:
      b = jax.tree.map(jnp.asarray, b)
      prox = compute_logprobs(CFG, prox_params, b.tokens, b.positions, b.segment_ids)
      value, g = value_and_grad(params, b, prox, jnp.float32(normalizer))
      total += float(value)
      grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    return total, grads

  # Padded: one sequence per row, one micro-batch, every row padded to the longest.
  padded = [batching.layout_rows(seqs, [[i] for i in range(len(seqs))], len(seqs), 64)]
  packed = batching.pack_sequences(seqs, 128, row_len=64)
  assert len(packed) > 1 and packed[0].tokens.shape == (2, 64)
  loss_pad, grad_pad = loss_and_grad(padded)
  loss_pack, grad_pack = loss_and_grad(packed)
  assert abs(loss_pad) > 1e-3
  assert loss_pack == pytest.approx(loss_pad, rel=1e-5, abs=1e-6)
  for a, b in zip(jax.tree.leaves(grad_pad), jax.tree.leaves(grad_pack)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def _seq(n_prompt, n_completion, adv):
  n = n_prompt + n_completion
  mask = np.r_[np.zeros(n_prompt), np.ones(n_completion)].astype(np.float32)
  return batching.SequenceData(np.ones(n, np.int32), mask, np.zeros(n, np.float32),
                               (mask * adv).astype(np.float32), np.zeros(n, np.int32))


def test_weight_sequences_equally_hand_values():
  # Policy tokens 2 and 6 (T = 8, N = 2): weights (8/2)/2 = 2 and (8/2)/6 = 2/3.
  seqs = [_seq(3, 2, 1.0), _seq(1, 6, -0.5), _seq(4, 0, 0.0)]
  out = batching.weight_sequences_equally(seqs)
  np.testing.assert_allclose(out[0].loss_weight, [2] * 5)
  np.testing.assert_allclose(out[1].loss_weight, [2 / 3] * 7, rtol=1e-6)
  assert out[2].loss_weight is None  # no policy tokens: untouched
  for a, b in zip(seqs, out):
    np.testing.assert_array_equal(a.advantages, b.advantages)  # advantages stay advantages
  # Weighted token mean == sequence mean of the advantages: (1 + (-0.5)) / 2.
  total = sum(float(np.sum(s.advantages * s.mask * s.loss_weight)) for s in out[:2])
  assert total / 8 == pytest.approx((1.0 - 0.5) / 2)
  packed = batching.pack_sequences(out, 64)[0]
  assert float(np.sum(packed.loss_weight * packed.mask)) == pytest.approx(8.0)  # = T: the scale is kept
  assert batching.weight_sequences_equally([]) == []


def _old_advantage_rescaling(sequences):
  """How sequence-mean aggregation used to work: advantages multiplied by (T / N) / n_i."""
  counts = [float(np.sum(s.mask)) for s in sequences]
  live = [n for n in counts if n > 0]
  per = sum(live) / len(live)
  return [s._replace(advantages=(s.advantages * (per / n)).astype(np.float32)) if n else s
          for s, n in zip(sequences, counts)]


@pytest.mark.slow(22)
@pytest.mark.parametrize("loss", ["ppo", "decoupled_ppo", "dis"])
def test_loss_weights_equal_the_old_advantage_rescaling(params, loss):
  """Sequence-mean as per-token loss weights gives the same loss and gradients, for every loss,
  as rescaling the advantages did (every L_t is linear in A_t for a positive factor)."""
  rng = np.random.default_rng(5)
  seqs = [_sequence(rng, 3, int(n), CFG.vocab_size) for n in rng.integers(2, 40, size=7)]
  seqs = [s._replace(advantages=(s.mask * rng.normal()).astype(np.float32)) for s in seqs]
  settings = LossSettings(loss=loss, eps_clip=0.2, eps_low=0.3, eps_high=0.5, behav_weight_cap=2.0)
  prox_params = jax.tree.map(lambda x: x * 0.97, params)

  @jax.jit
  def value_and_grad(p, b, prox):
    return jax.value_and_grad(lambda q: micro_batch_loss(q, b, prox, jnp.sum(b.mask), model=CFG,
                                                         settings=settings)[0])(p)

  def loss_and_grad(sequences):
    (b,) = batching.pack_sequences(sequences, 512)
    b = jax.tree.map(jnp.asarray, b)
    prox = compute_logprobs(CFG, prox_params, b.tokens, b.positions, b.segment_ids)
    return value_and_grad(params, b, prox if loss == "decoupled_ppo" else None)

  new_loss, new_grad = loss_and_grad(batching.weight_sequences_equally(seqs))
  old_loss, old_grad = loss_and_grad(_old_advantage_rescaling(seqs))
  unweighted, _ = loss_and_grad(seqs)
  assert float(new_loss) == pytest.approx(float(old_loss), rel=1e-5, abs=1e-7)
  assert max_abs_diff(new_grad, old_grad) < 1e-6
  assert abs(float(unweighted) - float(old_loss)) > 1e-4  # the weighting changes the loss at all

"""KV-cache decoding and packed sequences reproduce the plain full forward."""

import jax
import numpy as np
import pytest

from tests.fixtures.helpers import sharp_params
from asyncrl_jax import models

CFG = models.ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_seq_len=64, rope_theta=100.0)


@pytest.fixture(scope="module")
def params():
  return sharp_params(CFG, 0, scale=4.0)


def _rand_tokens(shape, seed=0):
  return np.random.default_rng(seed).integers(3, CFG.vocab_size, size=shape).astype(np.int32)


@pytest.mark.slow(19)
def test_prefill_then_steps_match_full_forward(params):
  tokens = _rand_tokens((3, 20))
  full = np.asarray(models.logits(CFG, params, tokens))
  cache = models.init_cache(CFG, 3, 32)
  prompt = 5
  positions = np.tile(np.arange(prompt), (3, 1))
  out, cache = models.decode(CFG, params, tokens[:, :prompt], positions, cache)
  steps = [np.asarray(out)]
  for t in range(prompt, 20):
    out, cache = models.decode(CFG, params, tokens[:, t:t + 1], np.full((3, 1), t), cache)
    steps.append(np.asarray(out))
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=1e-5)


def test_rows_at_different_positions(params):
  """Continuous batching: each row has its own prompt length and decodes at its own position."""
  lengths = [3, 9, 6]
  seqs = [_rand_tokens((1, 16), seed=i)[0] for i in range(3)]
  refs = [np.asarray(models.logits(CFG, params, s[None]))[0] for s in seqs]
  cache = models.init_cache(CFG, 3, 32)
  max_len = max(lengths)
  prompt = np.zeros((3, max_len), np.int32)
  for i, (s, n) in enumerate(zip(seqs, lengths)):
    prompt[i, :n] = s[:n]  # tail is padding; it lands in cache slots that are overwritten before use
  out, cache = models.decode(CFG, params, prompt, np.tile(np.arange(max_len), (3, 1)), cache)
  out = np.asarray(out)
  for i, n in enumerate(lengths):
    np.testing.assert_allclose(out[i, :n], refs[i][:n], atol=1e-5, rtol=1e-5)
  pos = np.array(lengths)
  for _ in range(5):
    tok = np.array([[seqs[i][pos[i]]] for i in range(3)], np.int32)
    out, cache = models.decode(CFG, params, tok, pos[:, None], cache)
    out = np.asarray(out)
    for i in range(3):
      np.testing.assert_allclose(out[i, 0], refs[i][pos[i]], atol=1e-5, rtol=1e-5)
    pos = pos + 1


def test_packed_equals_unpacked(params):
  lengths = [7, 12, 4]
  seqs = [_rand_tokens((1, n), seed=10 + i)[0] for i, n in enumerate(lengths)]
  row = 28  # 23 real tokens + 5 padding
  tokens = np.zeros((1, row), np.int32)
  positions = np.zeros((1, row), np.int32)
  segments = np.zeros((1, row), np.int32)
  start = 0
  for i, s in enumerate(seqs):
    tokens[0, start:start + len(s)] = s
    positions[0, start:start + len(s)] = np.arange(len(s))
    segments[0, start:start + len(s)] = i + 1
    start += len(s)
  packed = np.asarray(models.logits(CFG, params, tokens, positions=positions, segment_ids=segments))
  assert np.all(np.isfinite(packed))
  start = 0
  for s in seqs:
    alone = np.asarray(models.logits(CFG, params, s[None]))[0]
    np.testing.assert_allclose(packed[0, start:start + len(s)], alone, atol=1e-5, rtol=1e-5)
    start += len(s)
  # Without segment ids the second sequence would see the first: the test can tell the difference.
  unsegmented = np.asarray(models.logits(CFG, params, tokens, positions=positions))
  assert np.abs(unsegmented[0, 7:19] - packed[0, 7:19]).max() > 1e-3


def test_bad_tokens_rejected(params):
  with pytest.raises(ValueError, match=r"outside \[0, 50\)"):
    models.logits(CFG, params, np.array([[1, 2, 50]], np.int32))
  with pytest.raises(ValueError, match="integer"):
    models.logits(CFG, params, np.zeros((1, 3), np.float32))
  with pytest.raises(ValueError, match="2-D"):
    models.logits(CFG, params, np.zeros((3,), np.int32))
  with pytest.raises(ValueError, match="exceeds model.max_seq_len"):
    models.init_cache(CFG, 1, 65)


@pytest.mark.slow(17)
def test_fused_greedy_generate_matches_full_forward_argmax(params):
  from asyncrl_jax.models.generate import greedy_generate
  prompts = [_rand_tokens((1, n), seed=20 + n)[0] for n in (4, 7, 2)]
  prompt_bp = np.zeros((3, 8), np.int32)
  for i, p in enumerate(prompts):
    prompt_bp[i, :len(p)] = p
  eos = 0
  tokens, lengths = greedy_generate(CFG, params, prompt_bp, np.array([4, 7, 2], np.int32),
                                    max_new_tokens=10, eos_id=eos)
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  for i, p in enumerate(prompts):  # reference: re-run the full forward on the growing sequence
    seq = list(p)
    for _ in range(10):
      nxt = int(np.argmax(np.asarray(models.logits(CFG, params, np.array([seq], np.int32)))[0, -1]))
      seq.append(nxt)
      if nxt == eos:
        break
    want = seq[len(p):]
    assert lengths[i] == len(want)
    assert tokens[i, :lengths[i]].tolist() == want


def test_sampled_generate_follows_the_model_distribution(params):
  from asyncrl_jax.models.generate import generate
  from asyncrl_jax.models.sampling import SamplingSettings
  prompt = _rand_tokens((1, 5), seed=3)
  rows = 4000
  prompt_bp = np.repeat(prompt, rows, axis=0)
  lengths = np.full(rows, 5, np.int32)
  tokens, _ = generate(CFG, params, prompt_bp, lengths, jax.random.key(0), max_new_tokens=2, eos_id=-1,
                       settings=SamplingSettings(temperature=1.0))
  first = np.asarray(tokens)[:, 0]
  probs = np.asarray(jax.nn.softmax(models.logits(CFG, params, prompt)[0, -1]))
  freq = np.bincount(first, minlength=probs.size) / rows
  # 4000 draws: each frequency within 4.5 binomial standard deviations of its probability
  assert np.all(np.abs(freq - probs) <= 4.5 * np.sqrt(probs * (1 - probs) / rows) + 1e-3)
  # a near-zero temperature is greedy
  cold, _ = generate(CFG, params, prompt_bp[:4], lengths[:4], jax.random.key(1), max_new_tokens=6, eos_id=-1,
                     settings=SamplingSettings(temperature=1e-4))
  greedy, _ = generate(CFG, params, prompt_bp[:4], lengths[:4], max_new_tokens=6, eos_id=-1)
  np.testing.assert_array_equal(np.asarray(cold), np.asarray(greedy))
  with pytest.raises(ValueError, match="PRNG key"):
    generate(CFG, params, prompt_bp[:1], lengths[:1], max_new_tokens=2, eos_id=-1,
             settings=SamplingSettings(temperature=1.0))


def test_both_cache_layouts_hold_the_same_keys_and_values_and_decode_alike(params):
  """The "split" layout (keys, values) and the "paged" one (one array, each head's key and value side
  by side) are two arrangements of the same cache: prefill and steps give the same logits and the
  paged array, split apart, equals the pair."""
  from asyncrl_jax.models.transformer import split_kv
  tokens = _rand_tokens((3, 12))
  out = {}
  for layout in ("split", "paged"):
    cache = models.init_cache(CFG, 3, 16, layout=layout)
    logits, cache = models.decode(CFG, params, tokens[:, :8], np.tile(np.arange(8), (3, 1)), cache)
    steps = [np.asarray(logits)]
    for t in range(8, 12):
      logits, cache = models.decode(CFG, params, tokens[:, t:t + 1], np.full((3, 1), t), cache)
      steps.append(np.asarray(logits))
    out[layout] = np.concatenate(steps, axis=1), cache
  np.testing.assert_allclose(out["split"][0], out["paged"][0], atol=1e-6, rtol=1e-6)
  for pair, paged in zip(out["split"][1], out["paged"][1]):
    assert paged.shape == (3, 16, 2 * CFG.num_kv_heads, CFG.head_dim)
    for a, b in zip(pair, split_kv(paged)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.abs(np.asarray(pair[0])[:, :12]).min(axis=-1).max() > 0  # (control: written, not zeros)
  assert models.cache_length(out["split"][1]) == models.cache_length(out["paged"][1]) == 16
  with pytest.raises(ValueError, match="unknown KV cache layout 'pages'"):
    models.init_cache(CFG, 1, 8, layout="pages")


def test_the_ragged_decode_step_refuses_a_split_cache(params):
  cache = models.init_cache(CFG, 1, 16)
  with pytest.raises(ValueError, match='needs the KV cache in the "paged" layout'):
    models.apply_decode(CFG, params, np.zeros((1, 1), np.int32), np.zeros((1, 1), np.int32), cache,
                        decode="ragged")

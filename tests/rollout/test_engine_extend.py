"""Prefill with an existing prefix: appending tokens to a slot (or a JetStream prefix) that keeps its
cache gives the logits a prefill of the whole context gives, and the slot decodes on from there: with
decode steps over the whole cache (``xla``) and over its paged view (``ragged``, here the kernel's
XLA stand-in); the two engines decode the same greedy tokens with the same log-probs."""

import jax
import numpy as np
import pytest

from tests.fixtures.helpers import sharp_params
from asyncrl_jax import models
from asyncrl_jax.infra import sharding
from asyncrl_jax.rollout import Engine, SamplingSettings

CFG = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=64)


def _engine(decode_attention, temperature=0.0):
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=-1, fsdp=1, tensor=1))
  return Engine(CFG, mesh=mesh, num_slots=4, max_prefill_length=16, max_target_length=48,
                sampling=SamplingSettings(temperature=temperature), params=sharp_params(CFG, 0), seed=0,
                background_compile=False, decode_attention=decode_attention)


@pytest.fixture(scope="module", params=["xla", "ragged"])
def engine(request):
  return _engine(request.param)


def test_paged_decoding_gives_the_contiguous_tokens_and_logprobs_through_an_extend():
  """Sampled decoding (temperature 1, the same seed) with an extend between chunks: the paged engine
  draws the same tokens with the same recorded log-probs as the one reading the whole cache."""
  out = {}
  rng = np.random.default_rng(3)
  prompts = [list(rng.integers(3, 17, size=n)) for n in (5, 9, 3, 7)]
  for kind in ("xla", "ragged"):
    eng = _engine(kind, temperature=1.0)
    params = eng.load_params()
    state = eng.prefill_insert(params, eng.init_decode_state(), prompts, [0, 1, 2, 3], [20] * 4)
    state, t1, lp1, _ = eng.steps(params, state, 5)
    positions = np.asarray(state.positions)
    state = eng.extend(params, state, [[5, 6, 7], [8, 9]], [0, 3], [int(positions[0]), int(positions[3])],
                       [8, 8])
    state, t2, lp2, _ = eng.steps(params, state, 6)
    out[kind] = [np.asarray(x) for x in (t1, lp1, t2, lp2)]
  for a, b in zip(out["xla"][::2], out["ragged"][::2]):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(out["xla"][1::2], out["ragged"][1::2]):
    np.testing.assert_allclose(a, b, atol=1e-5)
  assert np.abs(out["xla"][3]).sum() > 0  # log-probs were recorded (the comparison is not of zeros)


def _full_logits(params, seq):
  return np.asarray(models.logits(CFG, params, np.array([seq], np.int32)))[0, -1]


def test_extend_equals_prefill_of_the_whole_context(engine):
  params = engine.load_params()
  host = jax.device_get(params)
  rng = np.random.default_rng(1)
  prompts = [list(rng.integers(3, 17, size=n)) for n in (5, 9, 3)]
  state = engine.prefill_insert(params, engine.init_decode_state(), prompts, [0, 2, 3], [6, 6, 6])
  state, tokens, _, n = engine.steps(params, state, 4)  # decode a few tokens first (some past the end)
  tokens = np.asarray(tokens)
  # slot 0 keeps 2 decoded tokens (the rest were decoded past its action's end), slot 2 keeps 4
  kept = {0: prompts[0] + tokens[0, :2].tolist(), 2: prompts[1] + tokens[2, :4].tolist()}
  obs = {0: [5, 6, 7], 2: [8, 9, 10, 11, 12, 13, 14]}
  state = engine.extend(params, state, [obs[0], obs[2]], [0, 2], [len(kept[0]), len(kept[2])], [5, 0])
  logits = np.asarray(state.logits)
  for slot in (0, 2):
    np.testing.assert_allclose(logits[slot], _full_logits(host, kept[slot] + obs[slot]), atol=2e-4)
  np.testing.assert_array_equal(np.asarray(state.budget)[[0, 2]], [5, 0])  # slot 2 stays parked
  np.testing.assert_array_equal(np.asarray(state.positions)[[0, 2]],
                                [len(kept[0]) + 3, len(kept[2]) + 7])
  # greedy decoding continues exactly as from the whole context
  seq = kept[0] + obs[0]
  state, t, _ = engine.step(params, state)
  assert int(np.asarray(t)[0]) == int(np.argmax(_full_logits(host, seq)))
  seq.append(int(np.asarray(t)[0]))
  np.testing.assert_allclose(np.asarray(state.logits)[0], _full_logits(host, seq), atol=2e-4)
  # negative control: extending from a wrong start (one token too late) does not give those logits
  state = engine.prefill_insert(params, state, [prompts[2]], [1], [4])
  state = engine.extend(params, state, [obs[0]], [1], [len(prompts[2]) + 1], [0])
  assert np.abs(np.asarray(state.logits)[1] - _full_logits(host, prompts[2] + obs[0])).max() > 1e-3


def test_jetstream_prefill_with_existing_prefix(engine):
  params = engine.load_params()
  host = jax.device_get(params)
  first, more = [3, 4, 5, 6], [7, 8, 9]
  padded = np.zeros(8, np.int32)
  padded[:len(first)] = first
  prefix = engine.prefill(params=params, padded_tokens=padded, true_length=len(first))
  padded2 = np.zeros(8, np.int32)
  padded2[:len(more)] = more
  longer = engine.prefill(params=params, existing_prefix=prefix, padded_tokens=padded2,
                          true_length=len(more))
  assert int(longer.length) == 7
  np.testing.assert_allclose(np.asarray(longer.logits)[0], _full_logits(host, first + more), atol=2e-4)
  state = engine.insert(longer, engine.init_decode_state(), 1)
  state, t, _ = engine.step(params, state)
  assert int(np.asarray(t)[1]) == int(np.argmax(_full_logits(host, first + more)))


def test_extend_refuses_what_does_not_fit(engine):
  params = engine.load_params()
  state = engine.init_decode_state()
  with pytest.raises(ValueError, match="exceed the cache length"):
    engine.extend(params, state, [[3] * 10], [0], [40], [1])
  with pytest.raises(ValueError, match="slot 7 outside"):
    engine.extend(params, state, [[3]], [7], [2], [1])
  with pytest.raises(ValueError, match="needs tokens"):
    engine.extend(params, state, [[]], [0], [2], [1])

"""The engine: greedy equals the full forward, recorded log-probs, the sampling distribution."""

import jax
import numpy as np
import pytest
from scipy import stats

from tests.fixtures.helpers import sharp_params
from asyncrl_jax import models
from asyncrl_jax.infra import sharding
from asyncrl_jax.models.sampling import sample, sampling_logits
from asyncrl_jax.rl.logprobs import compute_logprobs
from asyncrl_jax.rollout import Engine, SamplingSettings

CFG = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=64)


@pytest.fixture(scope="module")
def params():
  return sharp_params(CFG, 0)


def _engine(params, sampling, slots=4, devices=2, seed=0, **options):
  mesh = sharding.make_mesh(jax.devices()[:devices], dict(data=-1, fsdp=1, tensor=1))
  return Engine(CFG, mesh=mesh, num_slots=slots, max_prefill_length=16, max_target_length=48,
                sampling=sampling, params=params, seed=seed, **options)


def _prompts(n, seed=0):
  rng = np.random.default_rng(seed)
  return [list(rng.integers(3, 17, size=int(rng.integers(2, 9)))) for _ in range(n)]


def _run_slots(engine, params, prompts, steps):
  state = engine.init_decode_state()
  for slot, p in enumerate(prompts):
    padded = np.zeros(16, np.int32)
    padded[:len(p)] = p
    prefix = engine.prefill(params=params, padded_tokens=padded, true_length=len(p))
    state = engine.insert(prefix, state, slot)
  toks, lps = [], []
  for _ in range(steps):
    state, t, lp = engine.step(params, state)
    toks.append(np.asarray(t))
    lps.append(np.asarray(lp))
  return np.stack(toks, 1), np.stack(lps, 1)


def test_greedy_engine_equals_full_forward_greedy(params):
  engine = _engine(params, SamplingSettings(temperature=0.0))
  p = engine.load_params()
  prompts = _prompts(4)
  toks, lps = _run_slots(engine, p, prompts, 12)
  for i, prompt in enumerate(prompts):
    seq = list(prompt)
    for t in range(12):
      logits = np.asarray(models.logits(CFG, params, np.array([seq], np.int32)))[0, -1]
      nxt = int(np.argmax(logits))
      assert toks[i, t] == nxt, (i, t)
      lsm = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
      assert lps[i, t] == pytest.approx(lsm[nxt], abs=1e-4)
      seq.append(nxt)


@pytest.mark.slow(20)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_equal_recomputation(params, temperature):
  engine = _engine(params, SamplingSettings(temperature=temperature), seed=3)
  p = engine.load_params()
  prompts = _prompts(4, seed=1)
  toks, lps = _run_slots(engine, p, prompts, 20)
  for i, prompt in enumerate(prompts):
    seq = np.array(prompt + list(toks[i]), np.int32)[None]
    ref = np.asarray(compute_logprobs(CFG, params, seq, np.arange(seq.shape[1])[None],
                                      np.ones_like(seq), temperature=temperature))[0, len(prompt):]
    np.testing.assert_allclose(lps[i], ref, atol=2e-5)


def test_inserting_into_a_busy_batch_does_not_disturb_other_slots(params):
  engine = _engine(params, SamplingSettings(temperature=0.0))
  p = engine.load_params()
  prompts = _prompts(4, seed=2)
  alone, _ = _run_slots(engine, p, prompts[:1], 10)
  state = engine.init_decode_state()
  padded = np.zeros(16, np.int32)
  padded[:len(prompts[0])] = prompts[0]
  state = engine.insert(engine.prefill(params=p, padded_tokens=padded, true_length=len(prompts[0])),
                        state, 0)
  got = []
  for step in range(10):
    if step == 4:  # a new request arrives mid-way into slot 2
      padded = np.zeros(16, np.int32)
      padded[:len(prompts[1])] = prompts[1]
      state = engine.insert(engine.prefill(params=p, padded_tokens=padded,
                                           true_length=len(prompts[1])), state, 2)
    state, t, _ = engine.step(p, state)
    got.append(int(t[0]))
  assert got == list(alone[0])


def _sampled(engine, params, prompts, slots, streams, steps=12, budget=12):
  """Tokens [len(prompts), steps] sampled for each prompt, run in the given slots with those streams."""
  state = engine.prefill_insert(params, engine.init_decode_state(), prompts, slots, [budget] * len(prompts),
                                streams=streams)
  toks = []
  for _ in range(steps):
    state, t, _ = engine.step(params, state)
    toks.append(np.asarray(t)[slots])
  return np.stack(toks, 1)


def test_a_requests_samples_depend_on_its_id_not_on_its_server_slot_or_neighbours(params):
  """Several decode servers reproduce a run only if a request draws the same tokens wherever it
  runs: same id -> same tokens on another engine (another server's salt), in another slot, beside
  other requests; another id or another run seed -> other tokens (the negative controls)."""
  from asyncrl_jax.rollout.engine import sampling_stream  # pylint: disable=import-outside-toplevel
  settings = SamplingSettings(temperature=1.0)
  a, b = _engine(params, settings, stream_salt="decode-0"), _engine(params, settings, stream_salt="decode-1")
  p = a.load_params()
  prompts = _prompts(4, seed=5)
  ids = ["p7-s0", "p7-s1", "p8-s0", "p9-s3"]
  streams = [sampling_stream(i) for i in ids]
  first = _sampled(a, p, prompts, [0, 1, 2, 3], streams)
  # another server, the requests in other slots, and one of them beside different neighbours
  moved = _sampled(b, p, prompts[::-1], [1, 0, 3, 2], streams[::-1])[::-1]
  np.testing.assert_array_equal(first, moved)
  alone = _sampled(b, p, [prompts[2], _prompts(1, seed=9)[0]], [3, 1], [streams[2], sampling_stream("x")])
  np.testing.assert_array_equal(first[2], alone[0])
  # negative controls: another id, another run seed, an engine's own streams
  other_id = _sampled(a, p, prompts[:1], [0], [sampling_stream("p7-s9")])
  other_seed = _sampled(_engine(params, settings, seed=1), p, prompts[:1], [0], streams[:1])
  assert (other_id[0] != first[0]).any() and (other_seed[0] != first[0]).any()
  own_a = _sampled(a, p, prompts[:2], [0, 1], None)
  own_b = _sampled(b, p, prompts[:2], [0, 1], None)
  assert (own_a != own_b).any()  # servers' default streams differ (their salts)
  assert sampling_stream("p7-s0") == streams[0] and all(0 <= x < 2**31 for s in streams for x in s)
  with pytest.raises(ValueError, match="one stream"):
    a.prefill_insert(p, a.init_decode_state(), prompts[:2], [0, 1], streams=streams[:1])


@pytest.mark.slow(40)
@pytest.mark.parametrize("settings", [
    SamplingSettings(temperature=1.0),
    SamplingSettings(temperature=0.5),
    SamplingSettings(temperature=1.0, top_k=3),
    SamplingSettings(temperature=1.0, top_p=0.7),
])
def test_sampling_follows_the_configured_distribution(settings):
  logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)
  # Expected distribution computed independently in numpy.
  z = logits.astype(np.float64) / settings.temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  order = np.argsort(-p)
  keep = np.zeros(6, bool)
  if settings.top_k:
    keep[order[:settings.top_k]] = True
  else:
    keep[:] = True
  if settings.top_p < 1:
    cum = np.cumsum(p[order]) - p[order]
    keep_p = np.zeros(6, bool)
    keep_p[order[cum < settings.top_p]] = True
    keep &= keep_p
  expected = np.where(keep, p, 0)
  expected /= expected.sum()
  n = 40000
  tokens, logp = jax.jit(lambda k: sample(np.tile(logits, (n, 1)), k, settings))(jax.random.key(7))
  counts = np.bincount(np.asarray(tokens), minlength=6)
  assert np.all(counts[~keep] == 0)
  f_exp = expected[keep] / expected[keep].sum() * counts[keep].sum()
  _, pval = stats.chisquare(counts[keep], f_exp)
  assert pval > 1e-3, (counts, expected * n)
  # The recorded log-prob is that of the sampling distribution.
  np.testing.assert_allclose(np.exp(np.asarray(logp)), expected[np.asarray(tokens)], rtol=1e-5)
  masked = np.asarray(sampling_logits(logits[None], settings))[0]
  assert np.all((masked < -1e29) == ~keep)


def test_model_logprob_source_records_raw_distribution():
  logits = np.array([[2.0, 1.0, 0.5]], np.float32)
  settings = SamplingSettings(temperature=0.5, logprob_source="model")
  tok, lp = sample(logits, jax.random.key(0), settings)
  raw = logits[0] - np.log(np.exp(logits[0]).sum())
  assert float(lp[0]) == pytest.approx(raw[int(tok[0])], abs=1e-6)


def test_engine_rejects_bad_setup(params):
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=-1, fsdp=1, tensor=1))
  with pytest.raises(ValueError, match="num_slots=3 must be a multiple"):
    Engine(CFG, mesh=mesh, num_slots=3, max_prefill_length=16, max_target_length=48)
  with pytest.raises(ValueError, match="exceeds model.max_seq_len"):
    Engine(CFG, mesh=mesh, num_slots=2, max_prefill_length=16, max_target_length=65)
  engine = _engine(params, SamplingSettings())
  with pytest.raises(ValueError, match="true_length=20"):
    engine.prefill(params=engine.load_params(), padded_tokens=np.zeros(32, np.int32), true_length=20)
  with pytest.raises(ValueError, match="temperature=-1"):
    SamplingSettings(temperature=-1)


def test_prefill_plan_split_by_length_as_computed_by_hand():
  from asyncrl_jax.rollout.prefill_plan import prefill_plan
  lengths = np.array([12, 100, 12, 0, 12, 12, 12, 12])
  # one call: 8 rows x 128 + 256 = 1280; {100} at 128 (1 row) + six 12s at 16 (8 rows): 384 + 384 = 768;
  # {100, 12} at 128 (2 rows) + five 12s (8 rows at 16): 512 + 384 = 896.
  groups = prefill_plan(lengths, num_slots=8, max_len=128, call_overhead=256)
  assert [(sorted(g.tolist()), r, w) for g, r, w in groups] == [([1], 1, 128), ([0, 2, 4, 5, 6, 7], 8, 16)]
  # a large per-call overhead makes one call the cheaper plan
  (g, r, w), = prefill_plan(lengths, num_slots=8, max_len=128, call_overhead=5000)
  assert sorted(g.tolist()) == [0, 1, 2, 4, 5, 6, 7] and (r, w) == (8, 128)
  assert prefill_plan(np.zeros(8, int), num_slots=8, max_len=128) == []
  # Only some shapes available (compiled): {100} needs width 128, so it takes (2, 128) (cost 256) and the
  # 12s the cheapest shape of >= 6 rows, (8, 32) (256): 256 + 256 + 2 x 256 = 1024, less than (8, 128).
  groups = prefill_plan(lengths, num_slots=8, max_len=128, call_overhead=256,
                         available={(2, 128), (8, 128), (8, 32), (4, 16)})
  assert [(sorted(g.tolist()), r, w) for g, r, w in groups] == [([1], 2, 128), ([0, 2, 4, 5, 6, 7], 8, 32)]
  # the shapes to compile: rows 1, 4, 16, 64 and all 96 slots; widths the prefill buckets up to 144
  from asyncrl_jax.rollout.prefill_plan import prefill_shapes
  shapes = prefill_shapes(96, 144)
  assert shapes[0] == (96, 144) and len(shapes) == 5 * 5
  assert {r for r, _ in shapes} == {1, 4, 16, 64, 96} and {w for _, w in shapes} == {16, 32, 64, 128, 144}
  # nothing wide enough for the 100-token slot: no plan
  assert prefill_plan(lengths, num_slots=8, max_len=128, available={(8, 64)}) is None


def test_prefill_plan_cover_every_busy_slot_once_at_a_wide_enough_bucket():
  from asyncrl_jax.rollout.prefill_plan import PREFILL_BUCKETS, bucket_length, prefill_plan, row_bucket
  rng = np.random.default_rng(0)
  for trial in range(50):
    s = int(rng.integers(1, 97))
    lengths = np.where(rng.random(s) < 0.2, 0, rng.lognormal(3.0, 0.8, s).astype(int).clip(1, 200))
    available = None if trial % 2 else {(s, 256), (max(1, s // 4), 64), (s, 32), (2, 128)}
    groups = prefill_plan(lengths, num_slots=s, max_len=256, available=available)
    covered = np.concatenate([g for g, _, _ in groups]) if groups else np.array([], int)
    assert sorted(covered.tolist()) == np.flatnonzero(lengths > 0).tolist()
    for g, r, w in groups:
      assert w in PREFILL_BUCKETS + (256,) and w >= lengths[g].max() and len(g) <= r <= s
      assert available is None or (r, w) in available
    busy = int((lengths > 0).sum())
    one_call = (s if available else row_bucket(busy, s)) * 256 if busy else 0
    if available is None and busy:
      one_call = row_bucket(busy, s) * bucket_length(int(lengths.max()), 256)
    assert sum(r * w + 256 for _, r, w in groups) <= one_call + 256 * bool(busy)


@pytest.mark.slow(38)
@pytest.mark.parametrize("options", [{}, dict(attention_chunk=8, prefill_tokens=64)])
def test_refill_recomputes_every_busy_slot_as_a_full_forward(params, options):
  """Slots of very different lengths (several groups), one idle: after a refill under new weights each
  busy slot's next-token logits and the next greedy step equal a full forward of its sequence; also
  with blockwise attention and a cap on each call's tokens."""
  engine = _engine(params, SamplingSettings(temperature=0.0), slots=8, **options)
  old = engine.place_params(sharp_params(CFG, 5))
  state = engine.prefill_insert(old, engine.init_decode_state(), _prompts(8, seed=4), list(range(8)))
  rng = np.random.default_rng(2)
  lengths = np.array([3, 40, 5, 0, 21, 9, 33, 2], np.int32)
  tokens = rng.integers(3, 17, size=(8, 40)).astype(np.int32)
  before = np.asarray(state.logits)
  state = engine.refill(engine.load_params(), state, tokens, lengths)
  logits, positions = np.asarray(state.logits), np.asarray(state.positions)
  np.testing.assert_array_equal(logits[3], before[3])  # the idle slot is untouched
  state, step_tokens, _ = engine.step(engine.load_params(), state)
  after = np.asarray(state.logits)
  for i in np.flatnonzero(lengths):
    seq = list(tokens[i, :lengths[i]])
    want = np.asarray(models.logits(CFG, params, np.array([seq], np.int32)))[0, -1]
    np.testing.assert_allclose(logits[i], want, atol=1e-4)
    assert positions[i] == lengths[i] and step_tokens[i] == np.argmax(want)
    seq.append(int(step_tokens[i]))
    want = np.asarray(models.logits(CFG, params, np.array([seq], np.int32)))[0, -1]
    np.testing.assert_allclose(after[i], want, atol=1e-4)  # the cache the refill wrote is right
  if options:
    assert all(r * w <= 64 or r == 1 for r, w in engine.compiled_shapes()["refill"])


def test_refill_rejects_bad_shapes_and_lengths(params):
  engine = _engine(params, SamplingSettings(temperature=0.0), slots=4)
  p, state = engine.load_params(), engine.init_decode_state()
  with pytest.raises(ValueError, match="refill needs"):
    engine.refill(p, state, np.zeros((3, 8), np.int32), np.ones(3, np.int32))
  with pytest.raises(ValueError, match="the tokens given per slot"):
    engine.refill(p, state, np.zeros((4, 8), np.int32), np.array([1, 9, 1, 1], np.int32))
  with pytest.raises(ValueError, match="the cache has 48"):
    engine.refill(p, state, np.zeros((4, 60), np.int32), np.array([1, 48, 1, 1], np.int32))


def test_refill_uses_compiled_shapes_while_better_ones_compile_in_the_background(params):
  from asyncrl_jax.rollout.prefill_plan import prefill_plan
  engine = _engine(params, SamplingSettings(temperature=0.0), slots=8)
  engine.prefill_call_overhead = 16  # so that two calls beat one at these small sizes
  p = engine.load_params()
  rng = np.random.default_rng(3)
  tokens = rng.integers(3, 17, size=(8, 40)).astype(np.int32)

  def check(state, lengths):
    logits = np.asarray(state.logits)
    for i in np.flatnonzero(lengths):
      want = np.asarray(models.logits(CFG, params, tokens[i:i + 1, :lengths[i]]))[0, -1]
      np.testing.assert_allclose(logits[i], want, atol=1e-4)

  state = engine.init_decode_state()
  uniform = np.full(8, 40, np.int32)
  state = engine.refill(p, state, tokens, uniform)  # nothing compiled: the wanted (8, 48) runs, blocking
  assert engine.compiled_shapes()["refill"] == {(8, 48)} and not engine.compiles_pending()
  # wants the long slot alone at (1, 48) and the short ones at width 16, not one (8, 48) call
  mixed = np.array([40, 3, 4, 2, 5, 3, 0, 6], np.int32)
  state = engine.refill(p, state, tokens, mixed)  # runs on (8, 48) while those compile
  check(state, mixed)
  assert engine.wait_for_compiles(120)
  wanted = {(r, w) for _, r, w in prefill_plan(mixed, 8, 48, call_overhead=16)}
  assert (1, 48) in wanted and engine.compiled_shapes()["refill"] == {(8, 48)} | wanted
  state = engine.refill(p, state, tokens, mixed)  # now the wanted plan
  check(state, mixed)


def test_warm_up_compiles_every_prefill_shape_without_weights(params):
  engine = _engine(params, SamplingSettings(temperature=0.0), slots=4)
  engine.warm_up(engine.init_decode_state())
  assert engine.wait_for_compiles(120)
  # rows: powers of four up to the 4 slots; widths: prefill buckets up to 16 (prompts), 48 (cache)
  assert engine.compiled_shapes() == {"prefill_insert": {(1, 16), (4, 16)},
                                      "refill": {(r, w) for r in (1, 4) for w in (16, 32, 48)}}


@pytest.mark.slow(18)
def test_prefills_trace_once_per_allowed_shape_and_one_more_shape_trips_the_bound(params):
  """Warm-up traces every allowed refill shape (compiling from abstract arguments); a later call at
  one of them reuses that trace, and a shape outside the bucketing exceeds the bound."""
  engine = _engine(params, SamplingSettings(temperature=0.0), slots=4)
  p, state = engine.load_params(), engine.init_decode_state()
  engine.warm_up(state)
  assert engine.wait_for_compiles(120)
  assert len(engine.compiled_shapes()["refill"]) == 6
  tokens = np.full((4, 40), 3, np.int32)
  state = engine.refill(p, state, tokens, np.full(4, 40, np.int32))  # (4, 48): compiled, not retraced
  put = lambda x: jax.device_put(np.asarray(x, np.int32), engine._replicated)  # pylint: disable=protected-access
  with pytest.raises(AssertionError, match="refill#[0-9]+' is traced > 6 times"):
    engine._jit_refill(p, state, put(np.full((4, 24), 3)), put([1] * 4),  # pylint: disable=protected-access
                       put(range(4)))


@pytest.mark.parametrize("name", ["_jit_refill", "_jit_prefill_insert"])
def test_prefills_split_their_rows_over_the_data_axis(params, name):
  """A batched prefill (re-prefill or prefill-and-insert) of 4 rows into 8 slots on a data=4 rollout
  mesh costs each device about a quarter of the one-device compute, and fewer temporaries:
  the rows are split, not computed whole on every device. What crosses devices is the new rows'
  keys and values (to the devices of their slots), never a whole layer of the cache."""
  import re  # pylint: disable=import-outside-toplevel

  def compiled(devices):
    engine = _engine(params, SamplingSettings(temperature=1.0), slots=8, devices=devices,
                     background_compile=False)
    state = engine.init_decode_state()
    width = 48 if name == "_jit_refill" else 16
    tokens = jax.ShapeDtypeStruct((4, width), np.int32)
    rows = jax.ShapeDtypeStruct((4,), np.int32)
    extra = (rows,) * (1 if name == "_jit_refill" else 5)
    out = getattr(engine, name).lower(params, state, tokens, rows, *extra).compile()
    cost = out.cost_analysis()
    return out, (cost[0] if isinstance(cost, list) else cost)["flops"], jax.tree.leaves(state.cache)[0].shape
  one, one_flops, _ = compiled(1)
  four, four_flops, layer = compiled(4)
  assert four_flops < 0.35 * one_flops
  assert four.memory_analysis().temp_size_in_bytes < one.memory_analysis().temp_size_in_bytes
  # the result shapes of every collective that moves or combines data across devices, synchronous or
  # started asynchronously (whose result is a tuple of shapes)
  collective = re.compile(r"= (.*?) (?:all-gather|all-to-all|all-reduce|reduce-scatter|"
                          r"collective-permute)(?:-start)?\(")
  moved = [shape for result in collective.findall(four.as_text())
           for shape in re.findall(r"\[([\d,]+)\]", result)]
  assert moved  # (the control: the new keys and values do cross devices)
  assert ",".join(map(str, layer)) not in moved, (layer, moved)


@pytest.mark.slow(21)
def test_a_tensor_parallel_engine_splits_its_kv_cache_over_the_heads():
  """On a tensor-parallel server each device holds its kv heads' share of the cache, as it holds its
  share of the key and value projections (a cache replicated over ``tensor`` made the 7B decode
  server's programs need 2x its 95 GiB to compile); greedy decoding is unchanged."""
  cfg = CFG.replace(vocab_size=18)  # (the vocabulary splits over tensor too)
  params = sharp_params(cfg, 0)
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=1, fsdp=1, tensor=2))
  engine = Engine(cfg, mesh=mesh, num_slots=4, max_prefill_length=16, max_target_length=48,
                  sampling=SamplingSettings(temperature=0.0), params=params)
  state = engine.init_decode_state()
  keys, values = state.cache[0]  # [S, L, K, H] each: each device holds its kv heads' share
  for kv in (keys, values):
    assert kv.addressable_shards[0].data.shape == (4, 48, cfg.num_kv_heads // 2, cfg.head_dim)
  p = engine.load_params()
  prompts = _prompts(4)
  state = engine.prefill_insert(p, state, prompts, list(range(4)))
  toks = []
  for _ in range(6):
    state, t, _ = engine.step(p, state)
    toks.append(np.asarray(t))
  reference = Engine(cfg, mesh=sharding.make_mesh(jax.devices()[:2], dict(data=-1, fsdp=1, tensor=1)),
                     num_slots=4, max_prefill_length=16, max_target_length=48,
                     sampling=SamplingSettings(temperature=0.0), params=params)
  ref_state = reference.prefill_insert(reference.load_params(), reference.init_decode_state(), prompts,
                                       list(range(4)))
  want = []
  for _ in range(6):
    ref_state, t, _ = reference.step(reference.load_params(), ref_state)
    want.append(np.asarray(t))
  np.testing.assert_array_equal(np.stack(toks, 1), np.stack(want, 1))


def test_a_bfloat16_engine_holds_its_weights_in_the_serving_dtypes(params):
  """The decode server's copy is in ``models.serving_dtypes`` (bfloat16 kernels, float32 norm scales)
  whether the weights come from the learner or from the engine's own initialisation, and decodes as
  the learner's float32 weights do (the served copy gives the same logits bit for bit)."""
  cfg = CFG.replace(dtype="bfloat16")
  mesh = sharding.make_mesh(jax.devices()[:1], dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(cfg, mesh=mesh, num_slots=4, max_prefill_length=16, max_target_length=48,
                  sampling=SamplingSettings(temperature=0.0), params=params)
  want = models.serving_dtypes(cfg)
  for got in (engine.load_params(), engine.place_params(params), engine.param_spec(),
              Engine(cfg, mesh=mesh, num_slots=4, max_prefill_length=16, max_target_length=48).load_params()):
    assert jax.tree.map(lambda x: x.dtype, got) == want
  assert {str(d) for d in jax.tree.leaves(want)} == {"bfloat16", "float32"}
  served = engine.load_params()
  state = engine.prefill_insert(served, engine.init_decode_state(), _prompts(4), list(range(4)))
  logits = np.asarray(state.logits)
  unserved = engine.prefill_insert(params, engine.init_decode_state(), _prompts(4), list(range(4)))
  np.testing.assert_array_equal(logits, np.asarray(unserved.logits))

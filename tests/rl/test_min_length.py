"""A minimum length (``RolloutRequest.min_new_tokens``) is a sampling setting: the decode server bans
the stop tokens until a completion has that many tokens, records it, and the learner applies the same
ban, so at version 0 its log-probs are the recorded ones; without the ban they are not."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fixtures.helpers import NoStopTokenizer, sharp_params
from asyncrl_jax import config as config_lib, models
from asyncrl_jax.controller.controller import check_trajectory
from asyncrl_jax.data.workloads import LengthWorkload
from asyncrl_jax.infra import sharding
from asyncrl_jax.learner import group as learner_group
from asyncrl_jax.models.sampling import OUTSIDE, ban_stop_tokens
from asyncrl_jax.rl import batching
from asyncrl_jax.rl.logprobs import compute_logprobs
from asyncrl_jax.rollout import DecodeServer, Engine, RolloutRequest, SamplingSettings, protocol

CFG = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=64)
MAX_NEW = 24
MINIMUMS = [0, 0, 5, 5, 12, 12, 24, 24]  # per request (24: the whole completion)


@pytest.fixture(scope="module")
def params():
  return sharp_params(CFG, 0, scale=2.0)


@pytest.fixture(scope="module")
def stop_id(params):
  """The token the model samples most often: as the stop token, most completions would end early
  without a minimum length, so the ban changes the distribution by a lot."""
  counts = collections.Counter()
  for t in _rollouts(params, SamplingSettings(), tokenizer=NoStopTokenizer(), minimums=[0] * 8):
    counts.update(int(x) for x in t.completion_tokens if x >= 3)
  return counts.most_common(1)[0][0]


def _tokenizer(stop):
  class StopAt(NoStopTokenizer):
    stop_ids = (stop,)
  return StopAt()


def _rollouts(params, settings, *, tokenizer, minimums=MINIMUMS, refill_after=None):
  mesh = sharding.make_mesh(jax.devices()[:1], dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(CFG, mesh=mesh, num_slots=len(minimums), max_prefill_length=16, max_target_length=48,
                  sampling=settings, params=params, seed=5, tokenizer=tokenizer)
  server = DecodeServer(engine, params, steps_per_call=4)
  rng = np.random.default_rng(0)
  server.submit(*[RolloutRequest(prompt_tokens=[1] + list(rng.integers(3, 17, 4)), max_new_tokens=MAX_NEW,
                                 min_new_tokens=m, request_id=f"r{i}") for i, m in enumerate(minimums)])
  if refill_after is not None:  # new weights (the same values) mid-generation: every slot re-prefills
    for _ in range(refill_after):
      server.iteration(block=False)
    server.update_weights(params, 1)
  server.run_until_idle()
  out = {}
  while not server.finished.empty():
    t = server.finished.get()
    out[t.trajectory_id] = t
  assert len(out) == len(minimums)
  return [out[f"r{i}"] for i in range(len(minimums))]


def _learner_logp(params, trajectories, settings, ban_ids):
  """The learner's log-probs of every completion token, through the packed batch it trains on."""
  seqs = [batching.make_sequence(t.prompt_tokens, t.completion_tokens, logprobs=t.logprobs,
                                 versions=t.versions, min_new_tokens=t.sampling["min_new_tokens"])
          for t in trajectories]
  (batch,) = batching.pack_sequences(seqs, 512, row_len=64)
  temperature, top_k, top_p = settings.recorded()
  logp = np.asarray(compute_logprobs(CFG, params, batch.tokens, batch.positions, batch.segment_ids,
                                     temperature=temperature, top_k=top_k, top_p=top_p,
                                     eos_banned_bt=batch.eos_banned, eos_ban_ids=ban_ids))
  return logp[batch.mask > 0], batch.behav_logp[batch.mask > 0]


SETTINGS = [SamplingSettings(temperature=1.0), SamplingSettings(temperature=0.6, top_p=0.9, top_k=5),
            SamplingSettings(temperature=1.0, logprob_source="model")]


@pytest.mark.slow(23)
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.logprob_source}-T{s.temperature}"
                         f"-p{s.top_p}-k{s.top_k}")
def test_the_learner_applies_the_minimum_length_ban_of_the_behaviour_policy(params, stop_id, settings):
  trajectories = _rollouts(params, settings, tokenizer=_tokenizer(stop_id))
  for t, minimum in zip(trajectories, MINIMUMS):
    assert t.sampling["min_new_tokens"] == minimum
    assert len(t.completion_tokens) >= minimum and t.finish_reason in ("eos", "length")
    assert stop_id not in t.completion_tokens[:minimum].tolist()
    assert check_trajectory(t, RolloutRequest(list(t.prompt_tokens), MAX_NEW, min_new_tokens=minimum),
                            vocab_size=17, newest_version=0) == ""
  # without a minimum the stop token is likely: the ban is doing something
  assert np.mean([len(t.completion_tokens) for t in trajectories[:2]]) < 12
  learner, behav = _learner_logp(params, trajectories, settings, (stop_id,))
  assert abs(float(np.mean(behav - learner))) < 1e-5 and np.max(np.abs(behav - learner)) < 1e-4
  # negative control: the learner without the ban computes another distribution
  naive, _ = _learner_logp(params, trajectories, settings, ())
  assert abs(float(np.mean(behav - naive))) > 1e-3


def test_the_ban_survives_a_re_prefill_after_new_weights(params, stop_id):
  trajectories = _rollouts(params, SamplingSettings(), tokenizer=_tokenizer(stop_id), refill_after=2)
  assert all(t.num_interruptions >= 1 for t in trajectories if len(t.completion_tokens) > 8)
  for t, minimum in zip(trajectories, MINIMUMS):
    assert len(t.completion_tokens) >= minimum
    assert stop_id not in t.completion_tokens[:minimum].tolist()
  learner, behav = _learner_logp(params, trajectories, SamplingSettings(), (stop_id,))
  assert np.max(np.abs(behav - learner)) < 1e-4


def test_the_chunked_log_softmax_applies_the_same_ban():
  rng = np.random.default_rng(3)
  params = sharp_params(CFG, 1)
  tokens = rng.integers(0, 17, (2, 12)).astype(np.int32)
  positions = np.tile(np.arange(12, dtype=np.int32), (2, 1))
  segments = np.ones_like(tokens)
  banned = (rng.random((2, 12)) < 0.5).astype(np.float32)
  tokens[0, 3], banned[0, 3] = 7, 1.0  # a banned stop token that was sampled anyway: impossible
  full = np.asarray(compute_logprobs(CFG, params, tokens, positions, segments, temperature=0.8,
                                     eos_banned_bt=banned, eos_ban_ids=(7, 9)))
  chunked = np.asarray(compute_logprobs(CFG, params, tokens, positions, segments, temperature=0.8,
                                        vocab_chunk=5, eos_banned_bt=banned, eos_ban_ids=(7, 9)))
  assert full[0, 3] < OUTSIDE / 2 and chunked[0, 3] < OUTSIDE / 2
  ok = full > OUTSIDE / 2
  np.testing.assert_allclose(chunked[ok], full[ok], atol=2e-5)
  # by hand: the ban is a softmax over the vocabulary without the stop tokens
  logits = np.asarray(models.apply_logits(CFG, params, tokens, positions, segments)) / 0.8
  b, t = 1, int(np.argmax(banned[1, 1:] * (tokens[1, 1:] != 7) * (tokens[1, 1:] != 9))) + 1
  row = np.delete(logits[b, t - 1], [7, 9])
  want = logits[b, t - 1, tokens[b, t]] - (np.log(np.sum(np.exp(row - row.max()))) + row.max())
  assert full[b, t] == pytest.approx(want, abs=1e-4)
  out = np.asarray(ban_stop_tokens(jnp.zeros((2, 17)), jnp.asarray([1, 0]), (7, 9)))
  assert (out[0, [7, 9]] == OUTSIDE).all() and (np.delete(out[0], [7, 9]) == 0).all() and (out[1] == 0).all()


def test_the_ban_travels_with_the_request_the_sequence_and_the_learner_group_broadcast():
  r = RolloutRequest(prompt_tokens=[1, 2], max_new_tokens=9, min_new_tokens=4, request_id="x")
  assert protocol.request_from_pb(protocol.request_to_pb(r)).min_new_tokens == 4
  s = batching.make_sequence([1, 2], [3, 4, 5, 6, 7, 8], logprobs=np.zeros(6), versions=np.zeros(6),
                             min_new_tokens=4)
  assert s.eos_banned.tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
  assert batching.make_sequence([1], [3], min_new_tokens=0).eos_banned is None
  plain = batching.make_sequence([1, 2], [3, 4], advantage=1.0)
  back = learner_group.unpack_sequences(learner_group.pack_sequences([s, plain]))
  assert back[0].eos_banned.tolist() == s.eos_banned.tolist() and back[1].eos_banned.tolist() == [0] * 4
  assert back[1].loss_weight.tolist() == [1] * 4  # (1 is what no weight means)
  assert learner_group.unpack_sequences(learner_group.pack_sequences([plain]))[0].eos_banned is None


def test_a_trajectory_that_breaks_or_misrecords_its_minimum_is_refused(params):
  t = _rollouts(params, SamplingSettings(), tokenizer=NoStopTokenizer(), minimums=[6])[0]
  request = RolloutRequest(list(t.prompt_tokens), MAX_NEW, min_new_tokens=6)
  assert check_trajectory(t, request, vocab_size=17, newest_version=0) == ""
  assert "min_new_tokens=6" in check_trajectory(t, RolloutRequest(list(t.prompt_tokens), MAX_NEW,
                                                                  min_new_tokens=8),
                                                 vocab_size=17, newest_version=0)
  short = t.__class__(**{**t.__dict__, "completion_tokens": t.completion_tokens[:3],
                         "logprobs": t.logprobs[:3], "versions": t.versions[:3]})
  assert "fewer than min_new_tokens=6" in check_trajectory(short, request, vocab_size=17, newest_version=0)


def test_the_length_workload_draws_exact_lengths_reproducibly():
  w = LengthWorkload.parse("lognormal:median=32,sigma=1.15,cap=640")
  assert (w.median, w.sigma, w.cap) == (32, 1.15, 640) and LengthWorkload.parse(w.spec) == w
  assert LengthWorkload.parse("") is None
  draws = [w.draw(0, i, j) for i in range(400) for j in range(4)]
  assert draws == [w.draw(0, i, j) for i in range(400) for j in range(4)]  # same request, same length
  assert draws != [w.draw(1, i, j) for i in range(400) for j in range(4)]
  assert 1 <= min(draws) and max(draws) <= 640
  assert 28 <= np.median(draws) <= 36  # lognormal: the median is exp(mu)
  # the tail: P(L > 20 x median) = P(z > ln 20 / 1.15) = 0.45%, so about 7 of 1600 hit the cap region
  assert 0 < sum(d >= 640 for d in draws) < 30
  for bad, what in [("lognormal:median=32,sigma=1.15", "missing cap"), ("uniform:median=3,sigma=1,cap=9",
                    "kind"), ("lognormal:median=0.5,sigma=1,cap=9", "median"),
                    ("lognormal:median=3,sigma=x,cap=9", "not a number"),
                    ("lognormal:median=3,sigma=1,cap=9.5", "not an integer"),
                    ("lognormal:mean=3,sigma=1,cap=9", "not median=")]:
    with pytest.raises(ValueError, match=what):
      LengthWorkload.parse(bad)


def test_config_checks_the_minimum_length_and_the_workload():
  from configs import default  # pylint: disable=import-outside-toplevel
  config = default.get_config()
  config.rollout.min_new_tokens = 4
  config_lib.validate(config)
  config.rollout.min_new_tokens = config.data.max_completion_len + 1
  with pytest.raises(config_lib.ConfigError, match="rollout.min_new_tokens"):
    config_lib.validate(config)
  config.rollout.min_new_tokens = 0
  config.rollout.length_workload = "lognormal:median=32,sigma=1.15,cap=640"
  with pytest.raises(config_lib.ConfigError, match="data.max_completion_len"):
    config_lib.validate(config)
  config.rollout.length_workload = "lognormal:median=8,sigma=1.15,cap=64"
  config_lib.validate(config)
  config.rollout.min_new_tokens = 4
  with pytest.raises(config_lib.ConfigError, match="must be 0 with rollout.length_workload"):
    config_lib.validate(config)

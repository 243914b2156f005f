"""The learner's log-probs are in the distribution the behaviour log-probs were recorded in: at version
0, with no update, the two agree for every sampling setting; tokens outside the learner's truncated
set weigh 0 without NaN; a trajectory sampled with other settings stops the run."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from tests.fixtures.helpers import NoStopTokenizer, sharp_params
from asyncrl_jax import models
from asyncrl_jax.controller.controller import Controller, SamplingMismatch
from asyncrl_jax.data.pipeline import PromptStream
from asyncrl_jax.infra import sharding
from asyncrl_jax.models import lora, quant
from asyncrl_jax.models.sampling import OUTSIDE, truncated_logits
from asyncrl_jax.rl import batching
from asyncrl_jax.rl.logprobs import compute_logprobs
from asyncrl_jax.rl.objective import LossSettings, micro_batch_loss
from asyncrl_jax.rl.staleness import StalenessManager
from asyncrl_jax.rl.trajectory import Trajectory
from asyncrl_jax.rollout import DecodeServer, Engine, RolloutRequest, SamplingSettings
from asyncrl_jax.tokenization import ArithmeticTokenizer

CFG = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=64)


@pytest.fixture(scope="module")
def params():
  return sharp_params(CFG, 0, scale=2.0)


def _rollouts(params, settings: SamplingSettings, n: int = 8, max_new: int = 24, config=CFG, **engine_kw):
  mesh = sharding.make_mesh(jax.devices()[:1], dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(config, mesh=mesh, num_slots=n, max_prefill_length=16, max_target_length=48,
                  sampling=settings, params=params, seed=11, tokenizer=NoStopTokenizer(), **engine_kw)
  server = DecodeServer(engine, params, steps_per_call=8)
  rng = np.random.default_rng(0)
  server.submit(*[RolloutRequest(prompt_tokens=[1] + list(rng.integers(3, 17, 4)), max_new_tokens=max_new)
                  for _ in range(n)])
  server.run_until_idle()
  out = []
  while not server.finished.empty():
    out.append(server.finished.get())
  assert len(out) == n
  return out


def _learner_logp(params, trajectories, *, temperature=1.0, top_k=0, top_p=1.0, config=CFG):
  """The learner's log-probs of every completion token, one padded row per trajectory."""
  seqs = [np.concatenate([t.prompt_tokens, t.completion_tokens]) for t in trajectories]
  width = max(len(s) for s in seqs)
  tokens = np.zeros((len(seqs), width), np.int32)
  segments = np.zeros_like(tokens)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)], segments[i, :len(s)] = s, 1
  positions = np.tile(np.arange(width, dtype=np.int32), (len(seqs), 1))
  logp = np.asarray(compute_logprobs(config, params, tokens, positions, segments, temperature=temperature,
                                     top_k=top_k, top_p=top_p))
  return np.concatenate([logp[i, len(t.prompt_tokens):len(s)]
                         for i, (t, s) in enumerate(zip(trajectories, seqs))])


def _kl(behav, learner):
  """KL(behaviour || learner) estimated on tokens sampled from the behaviour policy."""
  return float(np.mean(behav - learner))


SETTINGS = [SamplingSettings(temperature=t, top_p=p, top_k=k, logprob_source="sampling")
            for t, p, k in itertools.product((0.6, 1.0), (1.0, 0.9), (0, 5))]
SETTINGS += [SamplingSettings(temperature=1.0, top_p=p, top_k=k, logprob_source="model")
             for p, k in ((1.0, 0), (0.9, 5))]


@pytest.mark.slow(74)
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.logprob_source}-T{s.temperature}"
                         f"-p{s.top_p}-k{s.top_k}")
def test_at_version_0_the_learner_computes_the_recorded_behaviour_log_probs(params, settings):
  trajectories = _rollouts(params, settings)
  behav = np.concatenate([t.logprobs for t in trajectories])
  temperature, top_k, top_p = settings.recorded()
  learner = _learner_logp(params, trajectories, temperature=temperature, top_k=top_k, top_p=top_p)
  assert len(behav) == 8 * 24
  assert abs(_kl(behav, learner)) < 1e-5
  assert np.max(np.abs(behav - learner)) < 1e-4
  truncated = settings.logprob_source == "sampling" and (settings.top_k or settings.top_p < 1)
  if truncated or settings.temperature != 1:
    # negative control: the learner's log-probs as they were (temperature only, or none at all)
    # miss by far more than the bound above, so the test can tell the two apart
    naive = _learner_logp(params, trajectories, temperature=temperature if truncated else 1.0,
                          top_k=0, top_p=1.0)
    assert abs(_kl(behav, naive)) > 1e-3


@pytest.mark.slow(20)
def test_int8_rollout_records_the_log_probs_of_the_int8_model_that_sampled(params):
  """``rollout.weight_dtype="int8"``: recomputed with the same quantized weights (dequantized), the
  learner's log-probs are the recorded ones; with the unquantized weights (the control) they are not:
  the mismatch the learner's behaviour correction then sees."""
  settings = SamplingSettings(temperature=1.0)
  trajectories = _rollouts(params, settings, weight_dtype="int8")
  behav = np.concatenate([t.logprobs for t in trajectories])
  served = quant.dequantize(quant.quantize(params), jnp.float32)
  exact = _learner_logp(served, trajectories)
  assert abs(_kl(behav, exact)) < 1e-5 and np.max(np.abs(behav - exact)) < 1e-4
  unquantized = _learner_logp(params, trajectories)
  assert np.max(np.abs(behav - unquantized)) > 1e-3


@pytest.mark.slow(20)
def test_lora_rollout_records_the_log_probs_of_base_plus_adapters(params):
  """LoRA: the server applies the adapters unmerged; the learner's (unmerged) log-probs are the
  recorded ones, the merged model's agree to rounding, and the base alone (the control) does not."""
  config = CFG.replace(lora_rank=4, lora_alpha=8.0)
  rng = np.random.default_rng(3)
  tuned = traverse_util.unflatten_dict({
      k: (jnp.asarray(rng.normal(size=v.shape) * 0.5, v.dtype) if str(k[-1]).endswith("_lora_b") else v)
      for k, v in traverse_util.flatten_dict(lora.add_adapters(config, params, jax.random.key(5))).items()})
  trajectories = _rollouts(tuned, SamplingSettings(temperature=1.0), config=config)
  behav = np.concatenate([t.logprobs for t in trajectories])
  unmerged = _learner_logp(tuned, trajectories, config=config)
  assert abs(_kl(behav, unmerged)) < 1e-5 and np.max(np.abs(behav - unmerged)) < 1e-4
  merged = _learner_logp(lora.merge(config, tuned)[1], trajectories)
  assert np.max(np.abs(behav - merged)) < 1e-4
  assert np.max(np.abs(behav - _learner_logp(params, trajectories))) > 1e-2


def test_truncated_logits_match_a_numpy_reference():
  rng = np.random.default_rng(1)
  logits = rng.normal(0, 2, (3, 4, 17)).astype(np.float32)
  got = np.asarray(truncated_logits(jnp.asarray(logits), temperature=0.7, top_k=6, top_p=0.8))
  for row, out in zip(logits.reshape(-1, 17), got.reshape(-1, 17)):
    x = row / 0.7
    keep = x >= np.sort(x)[-6]  # top 6
    order = np.argsort(-np.where(keep, x, -np.inf))
    p = np.exp(x[order] - x[order][0]) * keep[order]
    p /= p.sum()
    nucleus = order[:int(np.argmax(np.cumsum(p) >= 0.8)) + 1]  # smallest prefix with mass >= 0.8
    want = np.full(17, OUTSIDE, np.float32)
    want[nucleus] = x[nucleus]
    np.testing.assert_allclose(out, want, rtol=1e-6)


@pytest.mark.slow(44)
def test_a_token_outside_the_learners_truncated_set_weighs_nothing_and_gives_no_nan(params):
  """With top_k=4 only 4 of 17 tokens are in the set: every other sampled token gets weight 0, the loss
  and its gradient stay finite, and they equal those of the batch with those tokens masked out (the
  normaliser unchanged)."""
  rng = np.random.default_rng(2)
  seqs = []
  for _ in range(4):
    tokens = rng.integers(0, 17, 20).astype(np.int32)
    mask = np.r_[np.zeros(4), np.ones(16)].astype(np.float32)
    seqs.append(batching.SequenceData(tokens=tokens, mask=mask,
                                      behav_logp=np.where(mask > 0, -0.3, 0).astype(np.float32),
                                      advantages=np.where(mask > 0, rng.normal(), 0).astype(np.float32),
                                      versions=np.where(mask > 0, 0, -1).astype(np.int32)))
  (batch,), normalizer = batching.layout(seqs, batching.plan_micro_batches([20] * 4, 128)), 64.0
  batch = jax.tree.map(jnp.asarray, batch)
  top4 = np.asarray(compute_logprobs(CFG, params, batch.tokens, batch.positions, batch.segment_ids,
                                     top_k=4))
  inside = (top4 > OUTSIDE / 2) & (np.asarray(batch.mask) > 0)
  assert 0 < inside.sum() < np.asarray(batch.mask).sum()  # some tokens in the set, most outside
  for loss in ("ppo", "decoupled_ppo", "dis"):
    settings = LossSettings(loss=loss, top_k=4, eps_low=0.99, eps_high=1e6)

    def value_and_grad(b, settings=settings):
      return jax.value_and_grad(lambda q: micro_batch_loss(
          q, b, None, normalizer, model=CFG, settings=settings, prox_is_current=True), has_aux=True)(params)

    (value, metrics), grads = value_and_grad(batch)
    (value_in, _), grads_in = value_and_grad(batch._replace(mask=jnp.asarray(inside, jnp.float32)))
    assert np.isfinite(float(value)) and all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    np.testing.assert_allclose(float(value), float(value_in), rtol=1e-6, atol=1e-9)
    for g, g_in in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_in)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(g_in), rtol=1e-5, atol=1e-7)
    outside = 1 - inside.sum() / np.asarray(batch.mask).sum()
    np.testing.assert_allclose(float(metrics["outside_support_frac"]), outside, rtol=1e-6)
    assert float(metrics["policy_tokens"]) == np.asarray(batch.mask).sum()


@pytest.mark.parametrize("field, other, message", [
    ("top_p", SamplingSettings(temperature=1.0, top_p=0.9), "rollout.top_p=0.9, but the learner computes "
     "log-probs for rollout.top_p=1.0"),
    ("logprob_source", SamplingSettings(temperature=1.0, logprob_source="model"),
     "rollout.logprob_source='model', but the learner computes log-probs for "
     "rollout.logprob_source='sampling'")])
def test_a_trajectory_sampled_with_other_settings_stops_the_run_naming_server_and_field(field, other,
                                                                                        message):
  del field
  source = [{"question": f"{i}+1=".encode(), "answer": str(i + 1).encode(), "solution": b""}
            for i in range(8)]
  submitted = []
  ctl = Controller(prompts=PromptStream(source, seed=0, shard_index=0, shard_count=1),
                   tokenizer=ArithmeticTokenizer(), submit=lambda *r: submitted.extend(r),
                   manager=StalenessManager(batch_size=2, max_staleness=0, max_concurrent=8),
                   version=lambda: 0, reward=lambda text, answer: 0.0, batch_size=2, group_size=2,
                   max_new_tokens=8, sampling=SamplingSettings(temperature=1.0).record())
  ctl.pump()
  r = submitted[0]
  record = other.record()
  t = Trajectory(trajectory_id=r.request_id, prompt_id=r.prompt_id, group_id=r.group_id,
                 prompt_tokens=np.asarray(r.prompt_tokens, np.int32),
                 completion_tokens=np.asarray([4, 5], np.int32), logprobs=np.full(2, -0.5, np.float32),
                 versions=np.zeros(2, np.int32), finish_reason="eos",
                 logprob_source=record["logprob_source"], sampling=record, tokenizer_id="t",
                 server_id="decode-3")
  ctl.on_trajectory(t)
  with pytest.raises(SamplingMismatch, match=f"decode server 'decode-3' sampled {r.request_id} with "
                     + message.replace("(", r"\(")):
    ctl.next_batch(0, timeout=5)
  ctl.close()

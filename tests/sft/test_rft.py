"""Rejection-sampling fine-tuning (the supervised control without demonstrations) and the task
variant whose demonstrations stop at short chains."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fixtures.helpers import sharp_params
from asyncrl_jax import config as config_lib, models
from asyncrl_jax.data import builder as builder_lib, pipeline
from asyncrl_jax.infra import sharding
from asyncrl_jax.models.sampling import SamplingSettings
from asyncrl_jax.rl import batching
from asyncrl_jax.rl.evaluation import Evaluator
from asyncrl_jax.rl.logprobs import token_logprobs
from asyncrl_jax.sft.rejection import rejection_sampling_fine_tune, self_demonstrations
from asyncrl_jax.tokenization import ArithmeticTokenizer

TOK = ArithmeticTokenizer()
CFG = models.ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_seq_len=64)


def test_self_demonstrations_keep_only_right_and_finished_samples():
  eos = TOK.eos_id
  samples = [([1, 2], [5, 6, eos], 1.0),   # right, finished: kept
             ([1, 2], [5, 6, eos], 0.0),   # wrong
             ([3], [7, 8, 9], 1.0),        # right but cut off before EOS
             ([3], [eos], 1.0),            # right, finished
             ([4], [], 1.0)]               # nothing generated
  kept = self_demonstrations(samples, eos)
  assert [list(s.tokens) for s in kept] == [[1, 2, 5, 6, eos], [3, eos]]
  assert [list(s.mask) for s in kept] == [[0, 0, 1, 1, 1], [0, 1]]  # the loss is on the completion


def test_demonstrations_stop_at_short_chains(tmp_path):
  c = config_lib.base_config()
  c.data.update(num_train=120, num_test=20, min_terms=5, max_terms=8, demo_max_terms=3,
                path=str(tmp_path / "data"))
  config_lib.validate(c)
  prompts = pipeline.read_split(builder_lib.from_config(c, str(tmp_path)), "train")
  demos = pipeline.read_split(builder_lib.demonstrations_from_config(c, str(tmp_path)), "train")
  assert len(demos) == 120 and {d["num_terms"] for d in demos} <= {2, 3}
  assert min(p["num_terms"] for p in prompts) >= 5 and max(p["num_terms"] for p in prompts) <= 8
  assert (tmp_path / "data-demonstrations").is_dir()
  c.data.demo_max_terms = 0  # off: the warm start reads the task's own train split
  same = pipeline.read_split(builder_lib.demonstrations_from_config(c, str(tmp_path)), "train")
  assert [p["question"] for p in same] == [p["question"] for p in prompts]
  c.data.demo_max_terms = 1
  with pytest.raises(config_lib.ConfigError, match="data.demo_max_terms=1 is not allowed"):
    config_lib.validate(c)


def _nll(params, sequences):
  """Mean negative log-likelihood of the sequences' completion tokens (packed, one forward each)."""
  total, n = 0.0, 0.0
  for b in batching.pack_sequences(sequences, 256, row_len=32):
    logp = token_logprobs(CFG, params, jnp.asarray(b.tokens), jnp.asarray(b.positions),
                          jnp.asarray(b.segment_ids))
    total -= float(jnp.sum(logp * b.mask))
    n += float(b.mask.sum())
  return total / n


@pytest.mark.slow(44)
def test_rejection_sampling_trains_on_the_models_own_accepted_samples():
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  params = sharp_params(CFG, 3, scale=1.0)
  problems = [{"question": f"{i % 10}+{(i * 7) % 10}=", "answer": str(i % 10 + (i * 7) % 10)}
              for i in range(8)]
  # a reward the random model earns about half the time: an even number of characters
  reward = lambda text, answer: float(len(text) % 2 == 0)
  sampling = SamplingSettings(temperature=1.0)
  kwargs = dict(max_prompt_len=8, max_new_tokens=24)
  rounds = []
  trained, stats = rejection_sampling_fine_tune(
      CFG, params, mesh, problems, TOK, reward, sampling=sampling, samples=4, prompts_per_round=4,
      steps_per_round=15, batch_size=8, learning_rate=1e-2, token_budget=64, seed=5, max_steps=30,
      progress=lambda s, loss: rounds.append(s.rounds), **kwargs)
  assert stats.steps == 30 and rounds == list(range(1, stats.rounds + 1))
  assert stats.sampled == stats.rounds * 4 * 4
  # round 1 again, independently: same prompts, the same PRNG seed, the initial weights
  first = Evaluator(CFG, mesh, TOK, problems[:4], samples=4, sampling=sampling, seed=5 * 100_003, **kwargs)
  rewards = first.sample(params, reward)
  assert stats.sample_accuracy[0] == pytest.approx(float(np.mean(rewards)))
  kept = self_demonstrations(first.last_samples, TOK.eos_id)
  assert 0 < len(kept) <= stats.kept
  # what it kept became more likely; samples it rejected did not gain as much
  rejected = [batching.make_sequence(p, c) for p, c, r in first.last_samples if r != 1.0 and len(c)]
  gain_kept = _nll(params, kept) - _nll(trained, kept)
  gain_rejected = _nll(params, rejected) - _nll(trained, rejected)
  assert gain_kept > 0.3 and gain_kept > gain_rejected + 0.2


def test_self_demonstrations_of_episodes_put_no_loss_on_observations():
  """A kept episode (reward 1, ends with EOS) trains its actions only: its action mask holds."""
  from asyncrl_jax.sft.rejection import self_demonstrations  # pylint: disable=import-outside-toplevel
  eos = 2
  kept = self_demonstrations([([5, 6], [7, 8, 9, eos], 1.0, np.asarray([1, 0, 0, 1], np.float32)),
                              ([5], [7, eos], 0.0, np.ones(2, np.float32))], eos)
  assert len(kept) == 1
  np.testing.assert_array_equal(kept[0].mask, [0, 0, 1, 0, 0, 1])

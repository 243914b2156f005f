"""The held-out evaluation's figures: standard errors by hand, and a fresh sampling key per version."""

import jax
import numpy as np
import pytest

from tests.fixtures.helpers import sharp_params
from asyncrl_jax import models
from asyncrl_jax.infra import sharding
from asyncrl_jax.models.sampling import SamplingSettings
from asyncrl_jax.rl import evaluation
from asyncrl_jax.tokenization import load_tokenizer


def test_figures_and_standard_errors_by_hand():
  # greedy 0/1 over 4 problems: mean 0.5, sd (ddof 1) sqrt(1/3), SE sqrt(1/3)/2
  # sampled, 2 per problem: per-problem means 1, 0.5, 0, 0.5 -> mean 0.5, sd sqrt(1/6), SE sqrt(1/6)/2
  out = evaluation.figures(np.array([1, 0, 1, 0]), np.array([1, 1, 1, 0, 0, 0, 0, 1]), 2)
  assert out["greedy"] == 0.5 and out["greedy_se"] == pytest.approx(np.sqrt(1 / 3) / 2)
  assert out["sampled"] == 0.5 and out["sampled_se"] == pytest.approx(np.sqrt(1 / 6) / 2)
  # the SE is over problems: the same rewards read as 8 single samples would give another figure
  assert evaluation.figures(np.zeros(2), np.array([1, 1, 1, 0, 0, 0, 0, 1]), 1)["sampled_se"] == (
      pytest.approx(np.std([1, 1, 1, 0, 0, 0, 0, 1], ddof=1) / np.sqrt(8)))
  assert evaluation.figures(np.ones(1), None, 0) == {"greedy": 1.0, "greedy_se": 0.0, "sampled": None,
                                                      "sampled_se": None}


def test_each_version_draws_its_own_samples_and_one_version_the_same_ones():
  cfg = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, max_seq_len=64)
  tok = load_tokenizer("")
  if tok.vocab_size > cfg.vocab_size:
    cfg = cfg.replace(vocab_size=tok.vocab_size)
  mesh = sharding.make_mesh(jax.devices()[:1], dict(data=-1, fsdp=1, tensor=1))
  problems = [{"question": f"{a}+{a}=", "answer": str(2 * a)} for a in range(1, 7)]
  evaluator = evaluation.Evaluator(cfg, mesh, tok, problems, max_prompt_len=16, max_new_tokens=8,
                                   samples=4, sampling=SamplingSettings(temperature=1.0), seed=3)
  params = sharp_params(cfg, 0)

  def completions(version):
    evaluator.sample(params, lambda text, answer: 0.0, version=version)
    return [tuple(int(t) for t in c) for _, c, _ in evaluator.last_samples]

  assert completions(5) == completions(5)  # one version, one draw (paired across runs of a seed)
  assert completions(5) != completions(6)  # the next evaluation draws afresh
  assert completions(None) != completions(5)
  out = evaluator.evaluate(params, lambda text, answer: float(text.strip() == answer), version=2)
  assert set(out) == {"greedy", "sampled", "greedy_se", "sampled_se"} and out["sampled_se"] >= 0

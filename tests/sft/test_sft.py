"""The supervised warm start's update against a written-out reference, and its packing invariance."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.fixtures.helpers import max_abs_diff, sharp_params
from asyncrl_jax import models
from asyncrl_jax.infra import sharding
from asyncrl_jax.sft.supervised import demonstration, warm_start
from asyncrl_jax.tokenization import load_tokenizer

TOKENIZER = load_tokenizer("")
CFG = models.ModelConfig(vocab_size=TOKENIZER.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_seq_len=128)


def _examples(n=40, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    terms = rng.integers(0, 10, rng.integers(2, 9))
    partial = np.cumsum(terms)
    out.append(dict(question="+".join(map(str, terms)), solution=";".join(map(str, partial[1:]))
                    + f"#{partial[-1]}"))
  return out


def _mesh():
  return sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})


def _run(params, examples, token_budget, steps=1, grad_clip=1.0):
  out, _ = warm_start(CFG, params, _mesh(), examples, TOKENIZER, steps=steps, batch_size=16,
                      learning_rate=1e-2, seed=3, token_budget=token_budget, schedule="constant",
                      grad_clip=grad_clip)
  return jax.device_get(out)



def _reference(params, examples, grad_clip):
  """One step written out: the same 16 draws, unpacked (one sequence at a time), token-mean NLL."""
  idx = np.random.default_rng(3).integers(0, len(examples), 16)
  seqs = [demonstration(TOKENIZER, examples[j]["question"], examples[j]["solution"]) for j in idx]
  total = sum(float(s.mask.sum()) for s in seqs)

  # One row per sequence, padded at the end (a causal model's earlier positions do not see padding).
  width = max(len(x.tokens) for x in seqs)
  tokens = np.zeros((len(seqs), width), np.int32)
  mask = np.zeros((len(seqs), width), np.float32)
  for r, x in enumerate(seqs):
    tokens[r, :len(x.tokens)], mask[r, :len(x.tokens)] = x.tokens, x.mask

  def loss(p):
    logits = models.logits(CFG, p, jnp.asarray(tokens))
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1], axis=-1), tokens[:, 1:, None], -1)[..., 0]
    return -jnp.sum(logp * mask[:, 1:]) / total

  grads = jax.jit(jax.grad(loss))(params)
  optimizer = optax.chain(optax.clip_by_global_norm(grad_clip), optax.adamw(1e-2))
  updates, _ = optimizer.update(grads, optimizer.init(params), params)
  return optax.apply_updates(params, updates)


@pytest.mark.slow(29)
@pytest.mark.parametrize("grad_clip", [1e6, 0.05])
def test_one_step_equals_written_out_reference(grad_clip):
  params = jax.device_get(sharp_params(CFG, 1, scale=1.5))
  examples = _examples()
  got = _run(params, examples, token_budget=128, grad_clip=grad_clip)  # several micro-batches
  want = _reference(params, examples, grad_clip)
  moved = max_abs_diff(want, params)
  assert moved > 5e-3
  assert max_abs_diff(got, want) < 2e-2 * moved  # Adam's first step amplifies float noise near g = 0
  if grad_clip < 1:  # the clip is applied: unclipped differs
    assert max_abs_diff(_reference(params, examples, 1e6), want) > 10 * 2e-2 * moved


@pytest.mark.slow(23)
def test_packing_does_not_change_the_update_and_loss_falls():
  params = jax.device_get(sharp_params(CFG, 2, scale=1.0))
  examples = _examples(seed=1)
  small, large = _run(params, examples, token_budget=96, steps=3), _run(params, examples, 4096, steps=3)
  assert max_abs_diff(small, large) < 1e-3
  _, first = warm_start(CFG, params, _mesh(), examples, TOKENIZER, steps=1, batch_size=64,
                        learning_rate=1e-2, seed=0, token_budget=4096)
  _, later = warm_start(CFG, params, _mesh(), examples, TOKENIZER, steps=30, batch_size=64,
                        learning_rate=1e-2, seed=0, token_budget=4096)
  assert later < 0.8 * first


def test_bad_arguments_are_named():
  params = sharp_params(CFG, 0)
  for kwargs, match in [(dict(grad_clip=0.0), "grad_clip"), (dict(steps=0), "steps"),
                        (dict(schedule="linear"), "schedule"), (dict(max_seconds=-1.0), "max_seconds")]:
    args = dict(steps=1, batch_size=4, learning_rate=1e-3, seed=0, token_budget=256) | kwargs
    with pytest.raises(ValueError, match=match):
      warm_start(CFG, params, _mesh(), _examples(4), TOKENIZER, **args)
  with pytest.raises(ValueError, match="'solution'"):
    warm_start(CFG, params, _mesh(), [{"question": "1+1", "answer": "2"}], TOKENIZER, steps=1,
               batch_size=4, learning_rate=1e-3, seed=0, token_budget=256)
  with pytest.raises(ValueError, match="at least one example"):
    warm_start(CFG, params, _mesh(), [], TOKENIZER, steps=1, batch_size=4, learning_rate=1e-3, seed=0,
               token_budget=256)


def test_tool_demonstrations_put_no_loss_on_what_the_tool_answered():
  """The warm start of a tool run (``envs.observation_markers``: ``{`` and ``}`` in
  configs/tool_use.py) trains the call and the final answer, not the calculator's answer."""
  import os  # pylint: disable=import-outside-toplevel
  from asyncrl_jax import envs  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.config import config_module  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tokenization import ToolTokenizer  # pylint: disable=import-outside-toplevel
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  markers = envs.observation_markers(config_module(os.path.join(root, "configs", "tool_use.py")).get_config())
  assert markers == ("{", "}")
  tok = ToolTokenizer()
  solution = "[12+345]{357}[1+2]{3}#360"
  plain = demonstration(tok, "12+345+1+2=", solution)
  masked = demonstration(tok, "12+345+1+2=", solution, markers)
  np.testing.assert_array_equal(plain.tokens, masked.tokens)  # a character vocabulary: same tokens
  prompt = len(tok.encode_prompt("12+345+1+2="))
  text = [tok.decode([t]) for t in masked.tokens[prompt:-1]]
  assert "".join(text) == solution
  observed = [i for i, m in enumerate(masked.mask[prompt:-1]) if m == 0]
  assert "".join(text[i] for i in observed) == "{357}{3}"  # exactly the tool's answers
  assert masked.mask[-1] == 1 and plain.mask[prompt:].all()  # EOS trained; before: everything
  assert float(masked.mask.sum()) == float(plain.mask.sum()) - len("{357}{3}")
  unclosed = demonstration(tok, "1+2=", "[1+2]{3", markers)
  assert unclosed.mask[len(tok.encode_prompt("1+2=")):].all()  # no close marker: not a tool answer

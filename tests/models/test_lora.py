"""LoRA adapters (``model.lora``): a new adapter changes nothing, a trained one changes the logits by
exactly its low-rank term (checked against numpy and against the merged weights), the learner trains
the adapters alone (the base bit for bit unchanged, against a full-weight control), and a LoRA model
exports as the merged plain model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from tests.fixtures.helpers import random_sequences
from asyncrl_jax import config as config_lib, models
from asyncrl_jax.infra import sharding
from asyncrl_jax.learner import updater
from asyncrl_jax.learner.learner import Learner
from asyncrl_jax.models import lora

BASE = models.ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, max_seq_len=128)
LORA = BASE.replace(lora_rank=4, lora_alpha=8.0)
TOKENS = jnp.array([[1, 5, 9, 2, 7, 3, 11, 4]], jnp.int32)


def _with_b(params, value):
  """``params`` with every adapter's ``B`` filled by a fixed pseudo-random pattern times ``value``."""
  rng = np.random.default_rng(0)
  return traverse_util.unflatten_dict({
      k: (jnp.asarray(rng.normal(size=v.shape) * value, v.dtype) if str(k[-1]).endswith("_lora_b") else v)
      for k, v in traverse_util.flatten_dict(params).items()})


@pytest.fixture(scope="module")
def base():
  return models.init_params(BASE, jax.random.key(0))


def test_config_reads_the_section_and_refuses_bad_values():
  assert models.ModelConfig.from_mapping(dict(BASE.__dict__, lora={"rank": 8, "targets": "q, v"})).lora_targets == ("q", "v")
  for bad, field in ((dict(lora_rank=-1), "model.lora.rank"), (dict(lora_rank=2, lora_targets="q,x"), "model.lora.targets"),
                     (dict(lora_rank=2, lora_alpha=0.0), "model.lora.alpha"), (dict(lora_rank=2, lora_targets=""), "model.lora.targets")):
    with pytest.raises(models.ModelConfigError, match=field):
      BASE.replace(**bad)


def test_adapter_parameters_are_the_counted_ones_with_their_shapes(base):
  params = lora.add_adapters(LORA, base, jax.random.key(1))
  adapters, rest = lora.split(params)
  assert lora.count(params) == LORA.num_lora_params == 2 * 4 * (  # layers x rank x (in + out) per target
      (32 + 32) + (32 + 16) + (32 + 16) + (32 + 32) + (32 + 64) + (32 + 64) + (64 + 32))
  assert adapters[("layer_0", "attn", "q_lora_a")].shape == (32, 4)
  assert adapters[("layer_0", "attn", "q_lora_b")].shape == (4, 4, 8)
  assert all(not np.any(v) for k, v in adapters.items() if k[-1].endswith("_lora_b"))
  assert traverse_util.unflatten_dict(rest).keys() == base.keys()
  with pytest.raises(ValueError, match="already hold adapters"):
    lora.add_adapters(LORA, params, jax.random.key(1))


def test_a_new_adapter_changes_nothing_and_a_trained_one_adds_its_low_rank_term(base):
  params = lora.add_adapters(LORA, base, jax.random.key(1))
  plain = models.logits(BASE, base, TOKENS)
  np.testing.assert_allclose(models.logits(LORA, params, TOKENS), plain, atol=1e-5)
  trained = _with_b(params, 0.05)
  changed = models.logits(LORA, trained, TOKENS)
  assert np.abs(changed - plain).max() > 1e-2  # (negative control: the adapters are applied)
  merged_config, merged = lora.merge(LORA, trained)
  assert not merged_config.lora and lora.count(merged) == 0
  np.testing.assert_allclose(models.logits(merged_config, merged, TOKENS), changed, atol=1e-4)
  # the merged weight by hand, in numpy: W + alpha / r * A B
  a = np.asarray(trained["layer_1"]["mlp"]["down_lora_a"], np.float64)
  b = np.asarray(trained["layer_1"]["mlp"]["down_lora_b"], np.float64)
  want = np.asarray(base["layer_1"]["mlp"]["down"], np.float64) + 8.0 / 4 * a @ b
  np.testing.assert_allclose(merged["layer_1"]["mlp"]["down"], want, rtol=1e-5, atol=1e-6)


def test_adapters_only_on_some_targets():
  config = BASE.replace(lora_rank=2, lora_targets=("q", "down"))
  params = models.init_params(config, jax.random.key(0))
  names = {k[-1] for k in lora.split(params)[0]}
  assert names == {"q_lora_a", "q_lora_b", "down_lora_a", "down_lora_b"}


def _learner(model_config, params, mesh):
  c = config_lib.base_config()
  c.learner.token_budget = 128
  c.learner.learning_rate = 3e-2
  return Learner(model_config, params, mesh, c, versions=2)


@pytest.mark.slow(20)
def test_the_learner_trains_the_adapters_alone_with_their_state_sharded(base):
  """A version of the RL update with LoRA: every adapter moved, every base weight bit for bit the
  same, AdamW state only for the adapters, on the adapters' shardings. Control: the same learner
  without LoRA moves the base."""
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=1, fsdp=2, tensor=1))
  sequences = random_sequences(0, 12, BASE.vocab_size)
  params = lora.add_adapters(LORA, base, jax.random.key(1), mesh)
  learner = _learner(LORA, params, mesh)
  before_adapters, before_base = (jax.tree.map(np.asarray, part) for part in lora.split(learner.params))
  learner.train(sequences, version=0)
  after_adapters, after_base = lora.split(learner.params)
  assert all(np.array_equal(np.asarray(after_base[k]), v) for k, v in before_base.items())
  moved = {k for k, v in before_adapters.items() if not np.array_equal(np.asarray(after_adapters[k]), v)}
  # A's gradient is x^T (g B^T): zero while B is (a new adapter), so the first update moves B alone
  assert moved == {k for k in before_adapters if k[-1].endswith("_lora_b")}
  learner.train(random_sequences(1, 12, BASE.vocab_size), version=1)  # (sampled at 0: one version old)
  assert all(not np.array_equal(np.asarray(lora.split(learner.params)[0][k]), v)
             for k, v in before_adapters.items())
  assert all(np.array_equal(np.asarray(lora.split(learner.params)[1][k]), v) for k, v in before_base.items())
  moments = [s for s in jax.tree.leaves(learner.opt_state, is_leaf=lambda x: isinstance(
      x, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
  state_size = sum(x.size for s in moments for x in jax.tree.leaves((s.mu, s.nu)))
  assert state_size == 2 * LORA.num_lora_params
  shardings = traverse_util.flatten_dict(models.param_shardings(LORA, mesh))
  for s in moments:
    held = {path: m for path, m in traverse_util.flatten_dict(s.mu).items()
            if not isinstance(m, optax.MaskedNode)}  # (the frozen base: no state)
    assert {p[-1] for p in held} <= {f"{t}_lora_{x}" for t in LORA.lora_targets for x in "ab"}
    for path, m in held.items():
      assert m.sharding.is_equivalent_to(shardings[path], m.ndim), path
  control = _learner(BASE, base, mesh)
  control.train(sequences, version=0)
  assert not np.array_equal(np.asarray(control.params["layer_0"]["mlp"]["up"]),
                            np.asarray(base["layer_0"]["mlp"]["up"]))


def test_the_warm_start_trains_the_adapters_alone_or_every_weight(base):
  """``learner.warm_start_train``: "adapters" moves the adapters and keeps every base weight bit for
  bit; "all" (control) moves the base too. The config refuses "adapters" without LoRA."""
  from asyncrl_jax.sft.supervised import warm_start  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tokenization import load_tokenizer  # pylint: disable=import-outside-toplevel
  tokenizer = load_tokenizer("")
  cfg = LORA.replace(vocab_size=tokenizer.vocab_size)
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=1, fsdp=2, tensor=1))
  params = models.init_params(cfg, jax.random.key(2))
  params = _with_b(params, 0.1)  # (a non-zero B, so that A's gradient is not zero either)
  before_adapters, before_base = (jax.tree.map(np.asarray, part) for part in lora.split(params))
  examples = [dict(question="1+2+3", solution="3;6#6"), dict(question="4+4", solution="8#8")]
  run = lambda only: lora.split(jax.device_get(warm_start(
      cfg, params, mesh, examples, tokenizer, steps=2, batch_size=4, learning_rate=1e-2, seed=0,
      token_budget=128, adapters_only=only)[0]))
  adapters, frozen = run(True)
  assert all(np.array_equal(frozen[k], v) for k, v in before_base.items())
  assert all(not np.array_equal(adapters[k], v) for k, v in before_adapters.items())
  _, moved = run(False)
  assert not np.array_equal(moved[("layer_0", "mlp", "up")], before_base[("layer_0", "mlp", "up")])
  with pytest.raises(ValueError, match="adapters_only needs"):
    warm_start(BASE.replace(vocab_size=tokenizer.vocab_size), models.init_params(
        BASE.replace(vocab_size=tokenizer.vocab_size), jax.random.key(0)), mesh, examples, tokenizer,
        steps=1, batch_size=2, learning_rate=1e-2, seed=0, token_budget=128, adapters_only=True)
  config = config_lib.base_config()
  config.learner.warm_start_train = "adapters"
  with pytest.raises(config_lib.ConfigError, match="model.lora.rank > 0"):
    config_lib.validate(config)
  config.model.lora.rank = 8
  config_lib.validate(config)
  config.learner.warm_start_train = "base"
  with pytest.raises(config_lib.ConfigError, match="learner.warm_start_train"):
    config_lib.validate(config)


def test_a_lora_model_exports_as_the_merged_plain_model(base, tmp_path):
  trained = _with_b(lora.add_adapters(LORA, base, jax.random.key(1)), 0.05)
  models.export_hf(LORA, trained, str(tmp_path / "hf"))
  loaded_config, loaded = models.load_hf(str(tmp_path / "hf"))
  assert not loaded_config.lora
  np.testing.assert_allclose(models.logits(loaded_config, loaded, TOKENS),
                             models.logits(LORA, trained, TOKENS), atol=1e-4)


def test_peft_puts_the_exported_adapter_on_the_transformers_base_and_reproduces_the_logits(base, tmp_path):
  """The adapter in PEFT's layout, loaded by ``peft`` onto the base exported for ``transformers``,
  gives our LoRA model's logits; the base alone (the control) does not."""
  import peft
  import torch
  import transformers
  trained = _with_b(lora.add_adapters(LORA, base, jax.random.key(1)), 0.05)  # (every target)
  models.export_hf(*lora.base_model(LORA, trained), str(tmp_path / "base"))
  models.export_peft(LORA, trained, str(tmp_path / "adapter"), base_model=str(tmp_path / "base"))
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32).eval()
  tokens = torch.tensor(np.asarray(TOKENS))
  with torch.no_grad():
    plain = hf(tokens).logits.numpy()
    tuned = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    got = tuned(tokens).logits.numpy()
  want = np.asarray(models.logits(LORA, trained, TOKENS))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  assert np.abs(plain - want).max() > 1e-2  # (the adapters matter at this scale)
  import json
  written = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
  assert written["r"] == LORA.lora_rank and written["lora_alpha"] == LORA.lora_alpha
  assert set(written["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"}
  with pytest.raises(ValueError, match="has no LoRA adapters"):
    models.export_peft(BASE, base, str(tmp_path / "none"), base_model="x")

"""The families users bring (Qwen3 dense, Qwen3-MoE, Llama 3.1 with rope scaling, yarn): parity with
`transformers`, a control per feature showing that it changes the logits, and exports that
`transformers` reads back."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
import transformers

from asyncrl_jax import models
from asyncrl_jax.models import RopeScaling
from tests.fixtures.hf_models import make_hf_model, torch_logits

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}

# name -> make_hf_model's arguments: every feature on a tiny random model, head_dim unlike hidden /
# heads (64 / 8 = 8) wherever the family allows it
FAMILIES = {
    "qwen3": dict(arch="qwen3", head_dim=16),
    "qwen3_tied": dict(arch="qwen3", tie=True, head_dim=12),
    "qwen3_moe": dict(arch="qwen3_moe", head_dim=16, experts=8, top_k=2),
    "qwen3_moe_sparse_step": dict(arch="qwen3_moe", experts=4, top_k=2, norm_topk_prob=False,
                                  layers=3, decoder_sparse_step=2, mlp_only_layers=(0,)),
    "llama3_1": dict(arch="llama", rope_theta=500000.0, rope_scaling=LLAMA3, max_positions=64),
    "qwen3_yarn": dict(arch="qwen3", head_dim=16, rope_scaling=YARN, max_positions=64),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """Each family's checkpoint written once for the module: name -> (path, torch model)."""
  root = tmp_path_factory.mktemp("families")
  return {name: (str(root / name), make_hf_model(root / name, **kw)) for name, kw in FAMILIES.items()}


def _tokens(vocab, shape=(3, 40), seed=1):
  return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


def _max_diff(a, b):
  return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_match_transformers_and_the_export_reads_back(tmp_path, checkpoints, name):
  path, ref_model = checkpoints[name]
  with open(os.path.join(path, "config.json")) as f:
    hub = json.load(f)
  assert "rope_parameters" not in hub  # the hub's layout, not transformers 5's
  config, params = models.load_hf(path)
  tokens = _tokens(config.vocab_size)
  ours = np.asarray(models.logits(config, params, tokens))
  ref = torch_logits(ref_model, tokens)
  assert np.abs(ref).max() > 1.0  # not a comparison of near-zero numbers
  np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=0)
  # the export: transformers reads it and gives the original model's logits; we read it back exactly
  models.export_hf(config, params, str(tmp_path / "out"))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
  np.testing.assert_allclose(torch_logits(reloaded, tokens), ref, atol=1e-6, rtol=0)
  config2, params2 = models.load_hf(str(tmp_path / "out"))
  assert config2 == config
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_what_each_family_loads_as(checkpoints):
  configs = {name: models.load_hf(path)[0] for name, (path, _) in checkpoints.items()}
  q3, tied, moe, step = (configs[n] for n in ("qwen3", "qwen3_tied", "qwen3_moe", "qwen3_moe_sparse_step"))
  assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 16 and not q3.tie_embeddings
  assert tied.tie_embeddings and tied.head_dim == 12
  assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 32)
  assert moe.norm_topk_prob and moe.moe_layers == (0, 1)
  assert step.moe_layers == (1,) and not step.norm_topk_prob  # layer 0 listed dense, layer 2 off-step
  assert configs["llama3_1"].rope_scaling == RopeScaling(
      rope_type="llama3", factor=8.0, original_max_position_embeddings=16)
  assert configs["llama3_1"].rope_theta == 500000.0 and not configs["llama3_1"].qk_norm
  assert configs["qwen3_yarn"].rope_scaling.rope_type == "yarn"
  # active parameters: attention, norms, embeddings, the router and 2 of 8 experts per layer
  d, fe, e = 64, 32, 8
  assert moe.num_params - moe.num_active_params == moe.num_layers * (e - 2) * 3 * d * fe
  assert models.count_params(models.load_hf(checkpoints["qwen3_moe"][0])[1]) == moe.num_params


def test_control_qk_norm_scales_change_the_logits(checkpoints):
  config, params = models.load_hf(checkpoints["qwen3"][0])
  scales = np.asarray(params["layer_0"]["attn"]["q_norm"]["scale"])
  assert np.abs(scales - 1.0).max() > 0.1  # the checkpoint's scales are not all ones
  ones = jax.tree_util.tree_map_with_path(
      lambda p, x: np.ones_like(x) if any(getattr(k, "key", "") in ("q_norm", "k_norm") for k in p) else x,
      params)
  tokens = _tokens(config.vocab_size)
  assert _max_diff(models.logits(config, params, tokens), models.logits(config, ones, tokens)) > 1e-2


@pytest.mark.parametrize("name", ["llama3_1", "qwen3_yarn"])
def test_control_rope_scaling_changes_the_logits(checkpoints, name):
  config, params = models.load_hf(checkpoints[name][0])
  tokens = _tokens(config.vocab_size)
  off = config.replace(rope_scaling=RopeScaling())
  assert _max_diff(models.logits(config, params, tokens), models.logits(off, params, tokens)) > 1e-2


def test_control_norm_topk_prob_changes_the_logits(checkpoints):
  config, params = models.load_hf(checkpoints["qwen3_moe"][0])
  tokens = _tokens(config.vocab_size)
  other = config.replace(norm_topk_prob=False)
  assert _max_diff(models.logits(config, params, tokens), models.logits(other, params, tokens)) > 1e-2


def test_yarn_attention_factor_and_llama3_frequencies_by_hand():
  """The frequencies against values worked out from the formulas, not from transformers."""
  from asyncrl_jax.models import rope  # pylint: disable=import-outside-toplevel
  base = models.ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=1,
                            num_kv_heads=1, head_dim=16, rope_theta=10000.0, qkv_bias=False)
  plain, factor = rope.frequencies(base)
  np.testing.assert_allclose(plain, 10000.0 ** (-np.arange(0, 16, 2) / 16), rtol=1e-6)
  assert factor == 1.0
  llama = base.replace(rope_scaling=RopeScaling(rope_type="llama3", factor=8.0,
                                                 original_max_position_embeddings=64))
  inv, factor = rope.frequencies(llama)
  wavelen = 2 * np.pi / plain
  assert factor == 1.0
  # wavelengths under 64 / 4 = 16 kept; over 64 / 1 = 64 divided by 8; between, interpolated
  np.testing.assert_allclose(inv[wavelen < 16], plain[wavelen < 16], rtol=1e-6)
  np.testing.assert_allclose(inv[wavelen > 64], plain[wavelen > 64] / 8, rtol=1e-6)
  mid = (wavelen >= 16) & (wavelen <= 64)
  assert mid.any()
  smooth = (64 / wavelen[mid] - 1) / 3
  np.testing.assert_allclose(inv[mid], (1 - smooth) * plain[mid] / 8 + smooth * plain[mid], rtol=1e-6)
  yarn = base.replace(rope_scaling=RopeScaling(rope_type="yarn", factor=4.0,
                                                original_max_position_embeddings=64))
  inv, factor = rope.frequencies(yarn)
  assert factor == pytest.approx(0.1 * np.log(4.0) + 1.0)
  assert inv[0] == pytest.approx(plain[0]) and inv[-1] == pytest.approx(plain[-1] / 4)  # the two ends


def _hub_config(path, **changes):
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  for key, value in changes.items():
    if value is None:
      hf.pop(key, None)
    else:
      hf[key] = value
  return hf


@pytest.mark.parametrize("name,changes,pattern", [
    ("qwen3", {"model_type": "gemma3_text"}, "model_type='gemma3_text' is not supported"),
    ("qwen3_moe", {"model_type": "deepseek_v3"}, "model_type='deepseek_v3' is not supported"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3", {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "'longrope' is not supported"),
    ("llama3_1", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
    ("llama3_1", {"rope_scaling": {**LLAMA3, "rope_type": "yarn"}}, "'yarn' is not supported for "
                                                                    "model_type='llama'"),
    ("llama3_1", {"rope_scaling": dict(LLAMA3, low_freq_factor=None)}, r"missing \['low_freq_factor'\]"),
    ("qwen3_yarn", {"rope_scaling": dict(YARN, short_factor=[1.0])}, r"\['short_factor'\] are not supported"),
    ("qwen3", {"attention_bias": True}, "attention_bias=true"),
    ("qwen3_moe", {"num_experts": None}, r"missing \['num_experts'\]"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds model.num_experts=8"),
    ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared experts"),
])
def test_unsupported_features_are_refused_by_name(checkpoints, name, changes, pattern):
  hf = _hub_config(checkpoints[name][0], **changes)
  with pytest.raises(models.CheckpointError, match=pattern):
    models.config_from_hf(hf, "ckpt")


def test_transformers_5_layout_reads_the_same(tmp_path, checkpoints):
  """transformers 5 writes rope_parameters and num_local_experts; both layouts load alike."""
  path, ref_model = checkpoints["qwen3_moe"]
  ref_model.save_pretrained(str(tmp_path))
  with open(tmp_path / "config.json") as f:
    hf = json.load(f)
  assert "num_local_experts" in hf and "rope_parameters" in hf
  assert models.load_hf(str(tmp_path))[0] == models.load_hf(path)[0]
  yarn_path, yarn_model = checkpoints["qwen3_yarn"]
  yarn_model.save_pretrained(str(tmp_path / "yarn"))
  assert models.load_hf(str(tmp_path / "yarn"))[0] == models.load_hf(yarn_path)[0]


def test_export_of_a_moe_model_is_the_hubs_per_expert_layout(tmp_path, checkpoints):
  config, params = models.load_hf(checkpoints["qwen3_moe"][0])
  models.export_hf(config, params, str(tmp_path))
  from asyncrl_jax.models import safetensors_io  # pylint: disable=import-outside-toplevel
  names = set(safetensors_io.load(str(tmp_path / "model.safetensors")))
  assert "model.layers.1.mlp.experts.7.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
  assert not any("gate_up_proj" in n for n in names)
  with open(tmp_path / "config.json") as f:
    hf = json.load(f)
  assert hf["model_type"] == "qwen3_moe" and hf["num_experts"] == 8 and hf["norm_topk_prob"] is True
  shutil.rmtree(tmp_path)

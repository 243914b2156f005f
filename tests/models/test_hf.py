"""Parity with `transformers` and exact export/import round trips."""

import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers

from asyncrl_jax import models
from asyncrl_jax.models import safetensors_io
from tests.fixtures.hf_models import make_hf_model, torch_logits


def _tokens(vocab, shape=(3, 17), seed=1):
  return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("qwen2", True), ("llama", False)])
def test_logits_match_transformers(tmp_path, arch, tie):
  ref_model = make_hf_model(tmp_path, arch=arch, tie=tie)
  config, params = models.load_hf(str(tmp_path))
  assert config.num_kv_heads == 2 and config.num_heads == 8  # grouped-query attention
  assert config.qkv_bias == (arch == "qwen2") and config.tie_embeddings == tie
  assert config.rope_theta == 5000.0
  tokens = _tokens(config.vocab_size)
  ours = np.asarray(models.logits(config, params, tokens))
  ref = torch_logits(ref_model, tokens)
  assert ours.dtype == np.float32 and ours.shape == (3, 17, config.vocab_size)
  assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero numbers
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_export_reimport_is_exact_and_transformers_reads_it(tmp_path):
  ref_model = make_hf_model(tmp_path / "src")
  config, params = models.load_hf(str(tmp_path / "src"))
  models.export_hf(config, params, str(tmp_path / "out"))
  config2, params2 = models.load_hf(str(tmp_path / "out"))
  assert config2 == config
  flat1, tree1 = jax.tree.flatten(params)
  flat2, tree2 = jax.tree.flatten(params2)
  assert tree1 == tree2
  for a, b in zip(flat1, flat2):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # An independent reader: transformers loads our export and gives the original model's logits.
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
  tokens = _tokens(config.vocab_size)
  np.testing.assert_array_equal(torch_logits(reloaded, tokens), torch_logits(ref_model, tokens))
  # The original tensors come back bit for bit.
  src = safetensors_io.load(str(tmp_path / "src" / "model.safetensors"))
  out = safetensors_io.load(str(tmp_path / "out" / "model.safetensors"))
  assert set(src) == set(out)
  for name in src:
    np.testing.assert_array_equal(src[name], out[name])


def test_bfloat16_checkpoint_loads_exact_values(tmp_path):
  ref_model = make_hf_model(tmp_path, dtype=torch.bfloat16)
  config, params = models.load_hf(str(tmp_path))
  want = ref_model.model.layers[0].self_attn.q_proj.weight.detach().float().numpy()
  got = np.asarray(params["layer_0"]["attn"]["q"]).reshape(config.hidden_size, -1).T
  np.testing.assert_array_equal(got, want)


def test_sharded_index_checkpoint(tmp_path):
  make_hf_model(tmp_path / "src")
  config, params = models.load_hf(str(tmp_path / "src"))
  tensors = safetensors_io.load(str(tmp_path / "src" / "model.safetensors"))
  names = sorted(tensors)
  os.makedirs(tmp_path / "sharded")
  weight_map = {}
  for part, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
    file = f"model-0000{part + 1}-of-00002.safetensors"
    safetensors_io.save(str(tmp_path / "sharded" / file), {n: tensors[n] for n in chunk})
    weight_map.update({n: file for n in chunk})
  with open(tmp_path / "sharded" / "model.safetensors.index.json", "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  with open(tmp_path / "src" / "config.json") as f, open(tmp_path / "sharded" / "config.json", "w") as g:
    g.write(f.read())
  _, params2 = models.load_hf(str(tmp_path / "sharded"))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_experiment_on_a_checkpoint_computes_in_its_dtype_and_stores_in_its_param_dtype(tmp_path):
  from asyncrl_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  make_hf_model(tmp_path)
  config = config_lib.base_config()
  config.model.update(hf_path=str(tmp_path), dtype="bfloat16", param_dtype="float32")
  model_config = models.config_of(config)
  assert (model_config.dtype, model_config.param_dtype) == ("bfloat16", "float32")
  loaded, params = models.from_config(config, None)
  assert loaded == model_config
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype("float32")}

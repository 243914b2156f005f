"""A malformed checkpoint directory gives an error that names the problem."""

import json
import os
import struct

import numpy as np
import pytest

from asyncrl_jax import models
from asyncrl_jax.models import safetensors_io
from tests.fixtures.hf_models import make_hf_model


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("good")
  make_hf_model(path)
  return path


def _copy(src, dst):
  os.makedirs(dst, exist_ok=True)
  for name in os.listdir(src):
    with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
      g.write(f.read())
  return dst


def _edit_config(path, **changes):
  with open(path / "config.json") as f:
    cfg = json.load(f)
  for k, v in changes.items():
    if v is None:
      cfg.pop(k, None)
    else:
      cfg[k] = v
  with open(path / "config.json", "w") as f:
    json.dump(cfg, f)


def test_not_a_directory(tmp_path):
  with pytest.raises(models.CheckpointError, match="not a directory"):
    models.load_hf(str(tmp_path / "nope"))


def test_missing_config(tmp_path, good_dir):
  d = _copy(good_dir, tmp_path / "d")
  os.remove(d / "config.json")
  with pytest.raises(models.CheckpointError, match="missing config.json"):
    models.load_hf(str(d))


def test_config_not_json(tmp_path, good_dir):
  d = _copy(good_dir, tmp_path / "d")
  (d / "config.json").write_text("{not json")
  with pytest.raises(models.CheckpointError, match="config.json: not valid JSON"):
    models.load_hf(str(d))


@pytest.mark.parametrize("changes,pattern", [
    ({"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
    ({"num_hidden_layers": None}, r"missing required fields \['num_hidden_layers'\]"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope scaling"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_key_value_heads": 3}, "num_heads=8 must be a multiple of model.num_kv_heads=3"),
])
def test_bad_config_fields(tmp_path, good_dir, changes, pattern):
  d = _copy(good_dir, tmp_path / "d")
  _edit_config(d, **changes)
  with pytest.raises(models.CheckpointError, match=pattern):
    models.load_hf(str(d))


def test_no_safetensors(tmp_path, good_dir):
  d = _copy(good_dir, tmp_path / "d")
  os.remove(d / "model.safetensors")
  with pytest.raises(models.CheckpointError, match=r"no \*.safetensors files"):
    models.load_hf(str(d))


def test_truncated_safetensors(tmp_path, good_dir):
  d = _copy(good_dir, tmp_path / "d")
  data = (d / "model.safetensors").read_bytes()
  (d / "model.safetensors").write_bytes(data[: len(data) - 1000])
  with pytest.raises(models.CheckpointError, match="truncated file"):
    models.load_hf(str(d))


def test_garbage_header(tmp_path, good_dir):
  d = _copy(good_dir, tmp_path / "d")
  (d / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!" + b"\0" * 64)
  with pytest.raises(models.CheckpointError, match="header is not valid JSON"):
    models.load_hf(str(d))


def test_missing_and_misshapen_tensors(tmp_path, good_dir):
  tensors = safetensors_io.load(str(good_dir / "model.safetensors"))
  d = _copy(good_dir, tmp_path / "missing")
  safetensors_io.save(str(d / "model.safetensors"),
                      {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k})
  with pytest.raises(models.CheckpointError, match=r"missing tensors \['model.layers.1.mlp.up_proj"):
    models.load_hf(str(d))
  d = _copy(good_dir, tmp_path / "shape")
  bad = dict(tensors)
  bad["model.norm.weight"] = np.ones(7, np.float32)
  safetensors_io.save(str(d / "model.safetensors"), bad)
  with pytest.raises(models.CheckpointError, match=r"model.norm.weight has shape \(7,\)"):
    models.load_hf(str(d))
  d = _copy(good_dir, tmp_path / "extra")
  extra = dict(tensors)
  extra["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
  safetensors_io.save(str(d / "model.safetensors"), extra)
  with pytest.raises(models.CheckpointError, match="unexpected tensors"):
    models.load_hf(str(d))


def test_index_names_missing_file(tmp_path, good_dir):
  d = _copy(good_dir, tmp_path / "d")
  (d / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {"model.norm.weight": "model-00009-of-00009.safetensors"}}))
  with pytest.raises(models.CheckpointError, match="lists 'model-00009-of-00009.safetensors'"):
    models.load_hf(str(d))

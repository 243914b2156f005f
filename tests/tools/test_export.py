"""Exporting a run's policy: the HF export loads in transformers with our logits, the Orbax export
restores with orbax alone to the run's exact parameters, an export into a (fake) bucket reads back
with the same logits, and bad requests are named."""

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from asyncrl_jax import config as config_lib, models
from asyncrl_jax.infra import sharding
from asyncrl_jax.learner.learner import Learner
from asyncrl_jax.tools import export
from asyncrl_jax.train import runlog
from asyncrl_jax.train.checkpoint import Checkpointer, RunCheckpointer
from tests.fixtures.helpers import sharp_params
from tests.infra.test_paths import bucket  # noqa: F401  pylint: disable=unused-import


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A run's workdir: its config.json and checkpoints of versions 2 and 3 (params differ)."""
  workdir = tmp_path_factory.mktemp("run")
  config = config_lib.base_config()
  runlog.record_config(config, str(workdir / "config.json"))
  model_config = models.config_of(config)
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  ckpt = Checkpointer(str(workdir / "checkpoints"), async_save=False)
  saved = {}
  for step, seed in ((2, 4), (3, 5)):
    learner = Learner(model_config, sharp_params(model_config, seed, mesh=mesh), mesh, config, versions=10)
    ckpt.save(step, state=learner.checkpoint_state(), meta={"version": step})
    saved[step] = jax.device_get(learner.params)
  ckpt.close()
  return workdir, model_config, saved


@pytest.mark.slow(23)
def test_hf_export_loads_in_transformers_with_our_logits(run, tmp_path):
  transformers = pytest.importorskip("transformers")
  from tests.fixtures.hf_models import torch_logits  # pylint: disable=import-outside-toplevel
  workdir, model_config, saved = run
  result = export.export(str(workdir), str(tmp_path / "hf"), fmt="hf")
  assert result["step"] == 3 and {"config.json", "model.safetensors"} <= set(result["files"])
  assert "built-in tokenizer" in result["note"]
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
  tokens = np.random.default_rng(0).integers(0, model_config.vocab_size, size=(2, 11)).astype(np.int32)
  ours = np.asarray(models.logits(model_config, saved[3], tokens))
  assert np.abs(ours).max() > 1.0
  np.testing.assert_allclose(torch_logits(reloaded, tokens), ours, atol=1e-4, rtol=0)


def test_orbax_export_restores_with_orbax_alone_to_the_exact_parameters(run, tmp_path):
  workdir, model_config, saved = run
  result = export.export(str(workdir), str(tmp_path / "ox"), fmt="orbax", step=2)
  assert result["step"] == 2
  restored = ocp.StandardCheckpointer().restore(str(tmp_path / "ox" / "params"))  # no target, no project code
  want, got = jax.tree_util.tree_flatten_with_path(saved[2])[0], jax.tree_util.tree_flatten_with_path(restored)[0]
  assert [k for k, _ in got] == [k for k, _ in want]
  for (_, w), (_, g) in zip(want, got):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  described = json.loads((tmp_path / "ox" / "model_config.json").read_text())
  assert described["hidden_size"] == model_config.hidden_size and described["num_layers"] == model_config.num_layers


def test_bad_export_requests_are_named(run, tmp_path):
  workdir, _, _ = run
  with pytest.raises(export.ExportError, match=r"no checkpoint step 7 .*have \[2, 3\]"):
    export.export(str(workdir), str(tmp_path / "a"), step=7)
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "x").write_text("1")
  with pytest.raises(export.ExportError, match="is not empty"):
    export.export(str(workdir), str(tmp_path / "full"))
  with pytest.raises(export.ExportError, match="config.json not found"):
    export.export(str(tmp_path), str(tmp_path / "b"))
  with pytest.raises(export.ExportError, match="format 'onnx'"):
    export.export(str(workdir), str(tmp_path / "c"), fmt="onnx")
  with pytest.raises(export.ExportError, match=r"trained the full model .* no adapter to export as peft"):
    export.export(str(workdir), str(tmp_path / "d"), fmt="peft")


def test_a_lora_run_exports_its_adapter_for_peft_with_its_base_beside_it(tmp_path):
  """``--format=peft`` of a LoRA run that started from no checkpoint: the adapter tensors in PEFT's
  layout and the frozen base in ``base/``, named by the adapter config (peft itself loads them in
  ``tests/models/test_lora.py``)."""
  from flax import traverse_util
  from asyncrl_jax.models import hf, lora
  from asyncrl_jax.models import safetensors_io
  workdir = tmp_path / "run"
  workdir.mkdir()
  config = config_lib.base_config()
  config.model.lora.rank = 4
  runlog.record_config(config, str(workdir / "config.json"))
  model_config = models.config_of(config)
  mesh = sharding.make_mesh(jax.devices()[:2], {"data": 1, "fsdp": 2, "tensor": 1})
  params = jax.tree.map(lambda x: x + 0.5, sharp_params(model_config, 3, mesh=mesh))  # (B non-zero)
  learner = Learner(model_config, params, mesh, config, versions=10)
  ckpt = RunCheckpointer(str(workdir / "checkpoints"), async_save=False)
  ckpt.keep_base(learner, "")  # (a run from no checkpoint: its base is written once, beside the steps)
  ckpt.save(1, state=learner.checkpoint_state(), meta={"version": 1, "base": ckpt.base})
  ckpt.close()
  saved = jax.device_get(learner.params)
  merged = export.export(str(workdir), str(tmp_path / "hf"), fmt="hf")  # adapters on the written base
  _, want_merged = lora.merge(model_config, saved)
  for k, v in traverse_util.flatten_dict(models.load_hf(str(tmp_path / "hf"))[1]).items():
    np.testing.assert_allclose(v, np.asarray(traverse_util.flatten_dict(want_merged)[k]), rtol=1e-6, atol=1e-6)
  assert merged["format"] == "hf"
  result = export.export(str(workdir), str(tmp_path / "peft"), fmt="peft")
  assert {"adapter_config.json", "adapter_model.safetensors", "base"} <= set(result["files"])
  assert "base weights are in base/" in result["note"]
  written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
  assert written["base_model_name_or_path"] == str(tmp_path / "peft" / "base") and written["r"] == 4
  tensors = safetensors_io.load(str(tmp_path / "peft" / "adapter_model.safetensors"))
  want = hf.lora_to_peft(model_config, saved)
  assert set(tensors) == set(want) and len(want) == 2 * 7 * model_config.num_layers
  for k, v in want.items():
    np.testing.assert_array_equal(tensors[k], v)
  base_config, base = models.load_hf(str(tmp_path / "peft" / "base"))
  assert not base_config.lora
  for k, v in traverse_util.flatten_dict(lora.base_model(model_config, saved)[1]).items():
    np.testing.assert_array_equal(traverse_util.flatten_dict(base)[k], v)


def test_hf_export_into_a_bucket_reads_back_with_the_runs_logits(run, bucket):  # pylint: disable=redefined-outer-name
  workdir, model_config, saved = run
  result = export.export(str(workdir), "gs://bkt/hf", fmt="hf")
  assert result["step"] == 3 and {"config.json", "model.safetensors"} <= set(result["files"])
  assert "/bkt/hf/model.safetensors" in bucket
  with pytest.raises(export.ExportError, match="is not empty"):
    export.export(str(workdir), "gs://bkt/hf", fmt="hf")
  loaded_config, loaded = export.load_export("gs://bkt/hf")
  tokens = np.random.default_rng(1).integers(0, model_config.vocab_size, size=(2, 9)).astype(np.int32)
  ours = np.asarray(models.logits(model_config, saved[3], tokens))
  assert np.abs(ours).max() > 1.0
  np.testing.assert_allclose(np.asarray(models.logits(loaded_config, loaded, tokens)), ours, atol=1e-5, rtol=0)


def test_a_runs_config_is_read_from_a_bucket(bucket):  # pylint: disable=redefined-outer-name,unused-argument
  config = config_lib.base_config()
  runlog.record_config(config, "gs://bkt/run/config.json")
  assert export.run_config("gs://bkt/run").to_dict() == json.loads(config.to_json_best_effort())
  with pytest.raises(export.ExportError, match="gs://bkt/none/config.json not found"):
    export.run_config("gs://bkt/none")

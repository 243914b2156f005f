"""JetStream 0.2.2 imports without TensorFlow/seqio and under jax 0.10."""

import importlib.util
import logging

import jax
import pytest


def test_jetstream_imports_without_tensorflow():
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  from asyncrl_jax.rollout.jetstream_compat import engine_api, jetstream_pb2, orchestrator, server_lib
  assert hasattr(engine_api.Engine, "generate") and hasattr(engine_api.Engine, "prefill")
  assert hasattr(server_lib, "run") and hasattr(orchestrator, "Driver")
  assert hasattr(jetstream_pb2, "DecodeRequest")
  assert importlib.util.find_spec("tensorflow") is None
  assert root.level == level and root.handlers == handlers  # import did not hijack logging
  assert jax.tree_map is jax.tree.map  # our alias (jax 0.10 removed jax.tree_map)
  orchestrator.delete_pytree({"a": jax.numpy.ones(3)})  # exercises the jax.tree_map call site


def test_seqio_vocabularies_refuse_construction():
  import asyncrl_jax.rollout.jetstream_compat  # noqa: F401  pylint: disable=unused-import
  from seqio.vocabularies import SentencePieceVocabulary
  with pytest.raises(RuntimeError, match="seqio is not installed"):
    SentencePieceVocabulary("/nonexistent.model")

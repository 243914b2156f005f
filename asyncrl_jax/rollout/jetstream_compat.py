"""Import google-jetstream 0.2.2 without TensorFlow and under jax 0.10.

google-jetstream 0.2.2 is the last PyPI release (the upstream repository is archived). It has two
incompatibilities with the environment this project pins, both handled here and nowhere else:

1. Its ``engine.token_utils`` and ``engine.mock_utils`` import ``seqio.vocabularies`` for the
   ``Vocabulary`` / ``SentencePieceVocabulary`` type names. ``seqio`` pulls in TensorFlow (~2 GB), which
   this project does not install (``google-jetstream`` is installed with ``pip install --no-deps``).
   We register a minimal ``seqio.vocabularies`` module whose classes exist for imports and
   ``isinstance`` checks but refuse to be constructed. Our engine supplies its own tokenizer, so
   JetStream never builds a seqio vocabulary on our code paths.
2. Its orchestrator calls ``jax.tree_map``, removed from jax. We alias it to ``jax.tree.map``.

Importing ``jetstream.core.orchestrator`` also reconfigures the root logger (DEBUG level, a stdout
handler). We undo that so importing JetStream does not flood the user's console.

Use ``from asyncrl_jax.rollout.jetstream_compat import engine_api`` (etc.) instead of importing ``jetstream``
directly.
"""

from __future__ import annotations

import logging
import sys
import types

import jax

_SEQIO_MESSAGE = (
    "seqio is not installed (it requires TensorFlow). asyncrl_jax engines provide their own tokenizer; "
    "JetStream's seqio-based vocabularies are unavailable."
)


class _UnavailableVocabulary:
  """Stand-in for ``seqio.vocabularies.Vocabulary``: importable, never constructible."""

  def __init__(self, *args, **kwargs):
    del args, kwargs
    raise RuntimeError(_SEQIO_MESSAGE)


def _install_seqio_stub() -> None:
  try:
    import seqio  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    return  # a real seqio is installed: use it
  except ImportError:
    pass
  seqio = types.ModuleType("seqio")
  vocabularies = types.ModuleType("seqio.vocabularies")
  vocabularies.Vocabulary = type("Vocabulary", (_UnavailableVocabulary,), {})
  vocabularies.SentencePieceVocabulary = type(
      "SentencePieceVocabulary", (vocabularies.Vocabulary,), {})
  seqio.vocabularies = vocabularies
  seqio.__asyncrl_jax_stub__ = True
  sys.modules["seqio"] = seqio
  sys.modules["seqio.vocabularies"] = vocabularies


def _install_tree_map_alias() -> None:
  if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map


def _import_jetstream():
  _install_seqio_stub()
  _install_tree_map_alias()
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  try:
    # pylint: disable=import-outside-toplevel
    from jetstream.core import orchestrator as orchestrator_
    from jetstream.core import server_lib as server_lib_
    from jetstream.core.proto import jetstream_pb2 as jetstream_pb2_
    from jetstream.core.proto import jetstream_pb2_grpc as jetstream_pb2_grpc_
    from jetstream.engine import engine_api as engine_api_
    from jetstream.engine import tokenizer_api as tokenizer_api_
    from jetstream.engine import tokenizer_pb2 as tokenizer_pb2_
  finally:
    root.setLevel(level)
    for handler in list(root.handlers):
      if handler not in handlers:
        root.removeHandler(handler)
  return (engine_api_, tokenizer_api_, tokenizer_pb2_, orchestrator_, server_lib_, jetstream_pb2_,
          jetstream_pb2_grpc_)


(engine_api, tokenizer_api, tokenizer_pb2, orchestrator, server_lib, jetstream_pb2,
 jetstream_pb2_grpc) = _import_jetstream()

__all__ = [
    "engine_api", "tokenizer_api", "tokenizer_pb2", "orchestrator", "server_lib", "jetstream_pb2",
    "jetstream_pb2_grpc",
]

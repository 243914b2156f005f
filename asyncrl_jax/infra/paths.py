"""Files of a run's workdir, which is a local directory or an object-store prefix (``gs://bucket/run``).

Everything the main job, the export and the evaluation read or write goes through these functions, so
one workdir string works on a laptop and on a Cloud TPU pod whose hosts share a bucket. Remote paths
go through ``etils.epath``, which needs ``gcsfs`` (or TensorFlow) for real ``gs://`` I/O; a missing
backend is named when the first remote path is used (``RemoteStorageError``). Local paths behave as
plain ``os`` / ``open`` calls, and no remote path ever reaches them (``os.makedirs("gs://b/x")`` would
make a local directory named ``gs:``).

Object stores write whole objects, atomically, and cannot append or rename cheaply. So:

* ``write_text`` / ``write_bytes`` are atomic everywhere: locally a temporary file then ``os.replace``,
  remotely one object upload (readers see the old object or the new one).
* ``append_text`` appends locally; remotely it reads the object and writes it back with the text added.
  That costs the file's size per append, which suits one writer (process 0) adding one record per
  policy version to files of a few MB; each remote append is atomic, so a kill never cuts a record.
* ``RewrittenFile`` is a file written in pieces (an event file) and stored whole on every flush.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import posixpath
import shutil
import tempfile
from typing import Iterator

from etils import epath


class RemoteStorageError(ValueError):
  """A remote path was used without a backend that can read and write it."""


def is_remote(path: str) -> bool:
  """Whether ``path`` is an object-store URI (``gs://``, ``s3://``...) rather than a local path."""
  return "://" in str(path)


def join(path: str, *parts: str) -> str:
  """``path/part/...``: ``os.path.join`` locally, ``/`` always in a URI."""
  return posixpath.join(path, *parts) if is_remote(path) else os.path.join(path, *parts)


def absolute(path: str) -> str:
  """``path`` made absolute when local (``os.path.abspath`` would mangle ``gs://b/x`` to ``/cwd/gs:/b/x``)."""
  return str(path) if is_remote(path) else os.path.abspath(path)


@functools.cache
def _has_tensorflow() -> bool:
  return importlib.util.find_spec("tensorflow") is not None


def require_backend(path: str) -> None:
  """Raises ``RemoteStorageError`` when ``path`` is remote and nothing installed can reach it (epath
  uses TensorFlow's file system when TensorFlow is installed, else fsspec's). For ``gs://`` that is
  ``gcsfs``, which also brings ``google-cloud-storage``, which Orbax needs to list checkpoints there."""
  if not is_remote(path) or _has_tensorflow():
    return
  import fsspec  # pylint: disable=import-outside-toplevel
  scheme = str(path).split("://", 1)[0]
  try:
    fsspec.get_filesystem_class(scheme)
  except (ImportError, ValueError) as e:
    raise RemoteStorageError(f"{path}: {scheme}:// paths need a storage backend: pip install "
                             f"{'gcsfs' if scheme == 'gs' else 'its fsspec backend'} ({e})") from e


def _remote(path: str) -> epath.Path:
  require_backend(path)
  return epath.Path(path)


def _epath(path: str) -> epath.Path:
  return _remote(path) if is_remote(path) else epath.Path(path)


def exists(path: str) -> bool:
  return _remote(path).exists() if is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
  return _remote(path).is_dir() if is_remote(path) else os.path.isdir(path)


def listdir(path: str) -> list[str]:
  """The names in directory ``path``."""
  return [p.name for p in _remote(path).iterdir()] if is_remote(path) else os.listdir(path)


def makedirs(path: str) -> None:
  """Creates directory ``path`` and its parents; nothing to do remotely, where objects need no
  directories (and ``gcsfs`` would try to create a missing bucket)."""
  if not is_remote(path):
    os.makedirs(path, exist_ok=True)


def remove(path: str) -> None:
  """Deletes the file ``path``."""
  if is_remote(path):
    _remote(path).unlink()
  else:
    os.remove(path)


def remove_tree(path: str) -> None:
  """Deletes directory ``path`` and everything under it (nothing to do when it does not exist)."""
  p = _epath(path)
  if p.exists():
    p.rmtree()


def read_bytes(path: str) -> bytes:
  if is_remote(path):
    return _remote(path).read_bytes()
  with open(path, "rb") as f:
    return f.read()


def read_text(path: str) -> str:
  """The text of ``path`` (UTF-8, universal newlines, as ``open(path)`` reads it)."""
  if is_remote(path):
    return _remote(path).read_text()
  with open(path) as f:
    return f.read()


def write_bytes(path: str, data: bytes) -> None:
  """Writes ``path`` atomically: a reader or a kill sees the old file or the new one, never part."""
  if is_remote(path):
    _remote(path).write_bytes(data)
    return
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(data)
  os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
  """``write_bytes`` of ``text`` in UTF-8."""
  write_bytes(path, text.encode())


def append_text(path: str, text: str) -> None:
  """Adds ``text`` at the end of ``path`` (created if missing); remotely a read and a whole rewrite,
  for one writer only (see the module docstring)."""
  if is_remote(path):
    old = read_bytes(path) if exists(path) else b""
    write_bytes(path, old + text.encode())
    return
  with open(path, "a") as f:
    f.write(text)


def copy_tree(src: str, dst: str) -> None:
  """Copies directory ``src`` into ``dst`` (created), file by file, either side local or remote."""
  makedirs(dst)
  for name in listdir(src):
    s, d = join(src, name), join(dst, name)
    if isdir(s):
      copy_tree(s, d)
    elif is_remote(s) or is_remote(d):
      _epath(s).copy(_epath(d), overwrite=True)  # streamed in chunks, not read whole
    else:
      shutil.copyfile(s, d)


@contextlib.contextmanager
def local_dir(path: str) -> Iterator[str]:
  """``path`` itself when local; else a temporary local copy of it, for readers that only take local
  directories (``models.load_hf``, the tokenizer), deleted on exit."""
  if not is_remote(path):
    yield path
    return
  with tempfile.TemporaryDirectory(prefix="asyncrl_jax_") as tmp:
    copy_tree(path, tmp)
    yield tmp


class RewrittenFile:
  """A binary file written in pieces and stored whole (``write_bytes``) on every ``flush`` and on
  ``close``: how an append-only file is kept in an object store. Its content stays in memory."""

  def __init__(self, path: str):
    self.path, self._data, self.closed = path, bytearray(), False

  def write(self, data: bytes) -> int:
    self._data += data
    return len(data)

  def flush(self) -> None:
    if not self.closed:
      write_bytes(self.path, bytes(self._data))

  def close(self) -> None:
    self.flush()
    self.closed = True

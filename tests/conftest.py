"""Test setup: 8 virtual CPU devices (set before jax is imported anywhere)."""

import os

_flag = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent compilation cache per test session, shared by both xdist workers (they inherit the
# controller's environment) and by every process the tests start: the many runs of the same tiny
# configs compile each program once. Set JAX_COMPILATION_CACHE_DIR to choose the directory.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import tempfile  # pylint: disable=import-outside-toplevel
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="asyncrl_jax-jit-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  pylint: disable=wrong-import-position

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
  """The tests marked ``slow(seconds)`` run first, longest first: pytest-xdist hands tests to its
  workers in collection order, so the long multi-process runs start at once on both workers instead
  of one of them finishing the suite alone while the other waits."""
  del config
  def seconds(item):
    mark = item.get_closest_marker("slow")
    return -(mark.args[0] if mark and mark.args else 0)
  items.sort(key=seconds)

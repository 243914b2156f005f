"""Shared command-line plumbing: CPU device setup, the config flag, start-up validation."""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys


def ensure_cpu_devices(n: int) -> None:
  """Asks XLA for ``n`` virtual CPU devices unless the user chose a count. Call before importing jax.
  (Every entry point calls this first, so it also arms ``kill -USR1 PID``: every thread's stack to
  stderr, for a process that seems stuck; and caps glibc's malloc arenas, ``limit_malloc_arenas``.)"""
  faulthandler.register(signal.SIGUSR1, all_threads=True)
  limit_malloc_arenas()
  skip_absent_tpu()
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def skip_absent_tpu() -> None:
  """With libtpu installed (``launch/setup.sh --test`` or ``--tpu-compile``, to compile for TPUs here)
  on a machine without a TPU, JAX would still try the TPU backend at start and print libtpu's
  errors about its missing hardware. Unless ``JAX_PLATFORMS`` is set, or a CUDA plugin is installed
  (a GPU machine), such a machine then runs on the CPU without trying. A TPU VM (``/dev/accel*`` or
  ``/dev/vfio``, or ``TPU_WORKER_HOSTNAMES``) is left alone."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
    return
  if os.environ.get("TPU_WORKER_HOSTNAMES") is not None or os.path.exists("/dev/vfio") or \
      any(name.startswith("accel") for name in os.listdir("/dev") if os.path.isdir("/dev")):
    return
  if any(importlib.util.find_spec(p) is not None for p in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
    return
  os.environ["JAX_PLATFORMS"] = "cpu"


MALLOC_ARENAS = 2


def limit_malloc_arenas(n: int = MALLOC_ARENAS) -> None:
  """Caps glibc's malloc arenas at ``n`` (unless ``MALLOC_ARENA_MAX`` is set, which glibc read at
  start), before any thread starts. With its default of 8 per core, the many threads of a learner or
  decode server (gRPC, rewards, checkpoint writes, XLA) each spread host allocations over their own
  arena, and host RSS crept up 2-5% over 250 versions of the built-in job; capped at 2 it stayed
  within 1.2% (docs/decisions/0026-cap-malloc-arenas.md)."""
  if "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
    return
  try:
    ctypes.CDLL("libc.so.6").mallopt(-8, n)  # M_ARENA_MAX
  except (OSError, AttributeError):  # not glibc
    pass


def define_config_flag():
  """``--config=configs/x.py`` with ``--config.a.b=value`` overrides (locked: no new fields)."""
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  return config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).",
                                         lock_config=True)


def parse_flags(argv, flag_values=None):
  """``app.run``'s flag parser: a bad ``--config.x=value`` (unknown field, a value of the wrong type,
  a file that does not load) is one line on stderr naming it, and exit status 2, not a traceback."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  flag_values = flags.FLAGS if flag_values is None else flag_values
  try:
    return flag_values(argv)
  except flags.Error as e:  # absl: the flag and its value are in the message
    message = str(e).removeprefix("flag ")
    unknown = message.removeprefix("Unknown command line flag ").strip("'")
    given = [a for a in argv[1:] if a.split("=")[0] == f"--{unknown}"]
    if unknown.startswith("config.") and given:  # (absl's reading of a boolean with a bad value)
      _refuse(f"{given[0]}: not a boolean (True or False)")
    _refuse(message, "config error" if "config" in message else "error")
  except (AttributeError, KeyError, TypeError, ValueError, SyntaxError, OSError) as e:
    key = str(e).strip("'\"")
    culprit = next((a.split("=")[0] for a in argv[1:] if a.startswith("--config.")
                    and key in a.split("=")[0].removeprefix("--config.").split(".")), None)
    if culprit:
      _refuse(f"{culprit}: the config has no field {key!r}")
    _refuse(f"{type(e).__name__}: {e}")


def _refuse(message: str, kind: str = "config error") -> None:
  print(f"{kind}: {message}", file=sys.stderr)
  sys.exit(2)


def validated(config):
  """Validates a loaded config; on a bad value prints the message and exits with status 2."""
  from asyncrl_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  if config is None:
    print("error: --config is required, e.g. --config=configs/default.py", file=sys.stderr)
    sys.exit(2)
  try:
    return config_lib.validate(config)
  except config_lib.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    sys.exit(2)


def use_compile_cache(workdir: str) -> None:
  """Keeps compiled programs in ``WORKDIR/jax_cache`` (a local workdir; unless the environment names
  a cache, ``JAX_COMPILATION_CACHE_DIR``), so a run started again (after a preemption or a crash)
  loads what it compiled before instead of compiling it again."""
  import jax  # pylint: disable=import-outside-toplevel
  if os.environ.get("JAX_COMPILATION_CACHE_DIR") or "://" in workdir:
    return
  jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

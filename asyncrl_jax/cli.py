"""Shared command-line plumbing: CPU device setup, the config flag, start-up validation."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys


def ensure_cpu_devices(n: int) -> None:
  """Asks XLA for ``n`` virtual CPU devices unless the user chose a count. Call before importing jax.
  (Every entry point calls this first, so it also arms ``kill -USR1 PID``: every thread's stack to
  stderr, for a process that seems stuck.)"""
  faulthandler.register(signal.SIGUSR1, all_threads=True)
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def define_config_flag():
  """``--config=configs/x.py`` with ``--config.a.b=value`` overrides (locked: no new fields)."""
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  return config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).",
                                         lock_config=True)


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

"""``python -m asyncrl_jax.info --config=configs/x.py``: validated config, devices and model size."""

from __future__ import annotations

import sys

from absl import app

from asyncrl_jax import cli

_CONFIG = cli.define_config_flag()


def _flatten(d, prefix=""):
  for k, v in d.items():
    if isinstance(v, dict):
      yield from _flatten(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}", v


def main(argv=None) -> None:
  def _main(args):
    del args
    config = cli.validated(_CONFIG.value)
    for key, value in _flatten(config.to_dict()):
      print(f"{key}: {value}")
    if not config.model.hf_path:
      from asyncrl_jax import config as config_lib  # pylint: disable=import-outside-toplevel
      print(f"model parameters: {config_lib.model_config(config).num_params:,}")
    sys.stdout.flush()

  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()

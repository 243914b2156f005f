"""Plain serving with JetStream: ``python -m asyncrl_jax.tools.serve --checkpoint=DIR [--port=9000]``.

Runs JetStream's own orchestrator (``jetstream.core.orchestrator.Driver``, interleaved prefill and
generate on one engine) and gRPC server (``jetstream.core.server_lib.JetStreamServer``) over our engine
on an exported checkpoint (Hugging Face or Orbax, written by ``asyncrl_jax.tools.export``), so
JetStream's standard ``Decode`` RPC and client tools work against the model.

Notes on JetStream 0.2.2 behaviour (not ours to change):

* token-content requests get ``bos_id`` prepended (``is_bos``) and are padded to a prefill bucket;
  prompts longer than the prefill limit are cut to their last tokens by JetStream with a warning;
* the server binds ``[::]`` by default; we bind 127.0.0.1 unless ``--host`` says otherwise (and a
  ``--host`` beyond loopback needs ``--auth_token_file`` or ``ASYNCRL_AUTH_TOKEN``, see ``auth``);
* an exception in one of the Driver's threads terminates the process.
"""

from __future__ import annotations

from asyncrl_jax import cli

cli.ensure_cpu_devices(1)

# pylint: disable=wrong-import-position
import sys
from typing import Optional

import grpc
import jax
from absl import app, flags, logging

from asyncrl_jax.infra import auth

from asyncrl_jax.infra import sharding
from asyncrl_jax.models.sampling import SamplingSettings
from asyncrl_jax.rollout.engine import Engine
from asyncrl_jax.rollout.jetstream_compat import orchestrator, server_lib
from asyncrl_jax.tools.export import load_export

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "An export: Hugging Face (config.json + safetensors) "
                                  "or Orbax (model_config.json + params/), see asyncrl_jax.tools.export.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "Directory with tokenizer.json; '' = built-in "
                                 "(or the checkpoint directory if it holds a tokenizer.json).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
_PORT = flags.DEFINE_integer("port", 9000, "Port (0: any free port).")
_TOKEN_FILE = flags.DEFINE_string("auth_token_file", "", "Shared secret every call must carry "
                                  "(or ASYNCRL_AUTH_TOKEN); required for a --host beyond loopback.")
_SLOTS = flags.DEFINE_integer("slots", 8, "Concurrent decodes.")
_MAX_PREFILL = flags.DEFINE_integer("max_prefill_length", 64, "Longest prompt in tokens.")
_MAX_TARGET = flags.DEFINE_integer("max_target_length", 256, "Prompt + completion in tokens.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")


def start_server(engine: Engine, params, *, host: str = "127.0.0.1", port: int = 0, threads: int = 16,
                 token: Optional[str] = None) -> tuple[server_lib.JetStreamServer, int]:
  """Starts JetStream's orchestrator + gRPC server over ``engine``; returns it and the bound port.
  A non-loopback ``host`` needs a ``token``, which every call must then carry (``asyncrl_jax.infra.auth``:
  metadata ``x-asyncrl-token``)."""
  auth.require(host, token, "--host")
  if port == 0:
    import portpicker  # pylint: disable=import-outside-toplevel
    port = portpicker.pick_unused_port()
  driver = orchestrator.Driver(prefill_engines=[engine], generate_engines=[engine],
                               prefill_params=[params], generate_params=[params],
                               interleaved_mode=True)
  previous = server_lib._HOST  # pylint: disable=protected-access
  server_lib._HOST = host  # JetStream 0.2.2 reads its bind host from this module constant
  aio_server = grpc.aio.server
  if token:  # JetStream builds its asyncio server without interceptors: add the token check to it
    grpc.aio.server = lambda *a, **k: aio_server(*a, interceptors=[auth.AioServerToken(token)], **k)
  try:
    server = server_lib.JetStreamServer(driver, threads, port, grpc.insecure_server_credentials())
  finally:
    server_lib._HOST = previous
    grpc.aio.server = aio_server
  server.start()
  return server, port


def engine_for_checkpoint(path: str, *, tokenizer_path: str, slots: int, max_prefill_length: int,
                          max_target_length: int, temperature: float) -> tuple[Engine, object]:
  config, params = load_export(path, max_seq_len=max_target_length)  # HF or Orbax export
  mesh = sharding.make_mesh(jax.local_devices()[:1], dict(data=1, fsdp=1, tensor=1), role="serve")
  engine = Engine(config, mesh=mesh, num_slots=slots, max_prefill_length=max_prefill_length,
                  max_target_length=max_target_length,
                  sampling=SamplingSettings(temperature=temperature), tokenizer_path=tokenizer_path,
                  params=params)
  return engine, engine.load_params()


def main(argv=None) -> None:
  def _main(args):
    del args
    if not _CHECKPOINT.value:
      raise app.UsageError("--checkpoint is required")
    try:  # binding beyond loopback needs a shared secret: refused before the model loads
      token = auth.load_token(_TOKEN_FILE.value)
      auth.require(_HOST.value, token, "--host")
    except auth.AuthError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    import os  # pylint: disable=import-outside-toplevel
    tokenizer = _TOKENIZER.value
    if not tokenizer and os.path.exists(os.path.join(_CHECKPOINT.value, "tokenizer.json")):
      tokenizer = _CHECKPOINT.value
    engine, params = engine_for_checkpoint(
        _CHECKPOINT.value, tokenizer_path=tokenizer, slots=_SLOTS.value,
        max_prefill_length=_MAX_PREFILL.value, max_target_length=_MAX_TARGET.value,
        temperature=_TEMPERATURE.value)
    server, port = start_server(engine, params, host=_HOST.value, port=_PORT.value, token=token)
    logging.info("JetStream server for %s on %s:%d", _CHECKPOINT.value, _HOST.value, port)
    server.wait_for_termination()

  app.run(_main, argv=argv, flags_parser=cli.parse_flags)


if __name__ == "__main__":
  main()

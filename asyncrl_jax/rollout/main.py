"""A decode server as its own process: ``python -m asyncrl_jax.rollout.main --config=configs/default.py``.

It takes all of its process's devices as its rollout mesh (``mesh.rollout``: tensor parallel within
the host) and starts without weights (the learner pushes its version before it sends requests; requests
that come first wait), serves the rollout gRPC service on ``rollout.host:rollout.port`` (127.0.0.1 by
default; port 0 picks a free one, written to ``--port_file``), registers with the learner at
``rollout.learner_address`` (its address, model config and tokenizer id; a mismatch is refused and
this process exits 1 with the learner's reason), and pulls new weights shard by shard from every
learner process over ``jax.experimental.transfer`` when told to.
"""

from __future__ import annotations

from asyncrl_jax import cli

import os  # noqa: E402  pylint: disable=wrong-import-position

cli.ensure_cpu_devices(int(os.environ.get("ASYNCRL_CPU_DEVICES", "2")))

# pylint: disable=wrong-import-position
import signal
import sys
import threading

import jax
from absl import app, flags, logging

from asyncrl_jax import auth, models, sharding
from asyncrl_jax.rollout import registry
from asyncrl_jax.rollout.engine import engine_from_config, server_seed
from asyncrl_jax.rollout.server import DecodeServer
from asyncrl_jax.rollout.service import RolloutService, serve
from asyncrl_jax.transfer.remote import WeightReceiver

_CONFIG = cli.define_config_flag()
_PORT_FILE = flags.DEFINE_string("port_file", "", "Write the bound port here once serving.")
_SERVER_ID = flags.DEFINE_string("server_id", "decode-0", "Name recorded in trajectories.")


def main(argv=None) -> None:
  def _main(args):
    del args
    config = cli.validated(_CONFIG.value)
    try:  # binding beyond loopback needs a shared secret: refused before anything starts
      token = auth.load_token(config.rollout.auth_token_file)
      auth.require(config.rollout.host, token, "rollout.host")
    except auth.AuthError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    mesh = sharding.make_mesh(jax.local_devices(), config.mesh.rollout.to_dict(), role="mesh.rollout")
    # each server its own sampling seed: a group's requests spread over servers must not repeat
    engine = engine_from_config(config, mesh, models.config_of(config),
                                seed=server_seed(config.seed, _SERVER_ID.value))
    # No weights until the learner pushes its current version (version -1 accepts any).
    server = DecodeServer(engine, None, version=-1, server_id=_SERVER_ID.value,
                          on_weight_update=config.rollout.on_weight_update,
                          warm_up=config.rollout.warm_up)
    host = config.rollout.host
    service = RolloutService(server, WeightReceiver(f"{host}:0"))
    grpc_server, port = serve(service, host=host, port=config.rollout.port, token=token)
    server.start()
    logging.info("decode server %s on %s:%d (%d devices, %d slots)", _SERVER_ID.value, host, port,
                 len(jax.local_devices()), engine.num_slots)
    if config.rollout.learner_address:
      try:
        n = registry.register(config.rollout.learner_address, server_id=_SERVER_ID.value,
                              address=f"{host}:{port}", model_config=engine.config,
                              tokenizer_id=engine.tokenizer.identity, devices=len(jax.local_devices()),
                              mesh=dict(mesh.shape), timeout=config.rollout.register_timeout,
                              token=token)
      except registry.RegistrationRefused as e:
        logging.error("the learner refused this decode server: %s", e)
        grpc_server.stop(grace=0)
        server.stop()
        sys.exit(1)
      logging.info("registered with the learner at %s (%d servers so far)",
                   config.rollout.learner_address, n)
    if _PORT_FILE.value:
      tmp = _PORT_FILE.value + ".tmp"
      with open(tmp, "w") as f:
        f.write(str(port))
      os.replace(tmp, _PORT_FILE.value)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, lambda *_: done.set())
    while not done.wait(1.0):
      if server.error is not None:
        logging.error("decode server failed: %r", server.error)
        break
    grpc_server.stop(grace=2).wait()
    server.stop()

  app.run(_main, argv=argv, flags_parser=cli.parse_flags)


if __name__ == "__main__":
  main()

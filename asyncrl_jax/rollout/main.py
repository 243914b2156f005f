"""A decode server as its own process: ``python -m asyncrl_jax.rollout.main --config=configs/default.py``.

It takes all of its process's devices as its rollout mesh (``mesh.rollout``: tensor parallel within
the host) and starts without weights (the learner pushes its version before it sends requests; requests
that come first wait), serves the rollout gRPC service on ``rollout.host:rollout.port`` (127.0.0.1 by
default; port 0 picks a free one, written to ``--port_file``), registers with the learner at
``rollout.learner_address`` (its address, model config and tokenizer id; a mismatch is refused and
this process exits 1 with the learner's reason), and pulls new weights shard by shard from every
learner process over ``jax.experimental.transfer`` when told to.

It repeats its registration every ``rollout.register_interval`` seconds (``registry``), so a learner
restarted from its checkpoint at the same registry address re-attaches to it; the new learner's
weights replace the old learner's work (``service``). On SIGTERM it drains: no new work, its queue
goes back to the learner, sequences in flight finish for at most ``rollout.drain_timeout`` seconds
(the rest go back too), everything finished is delivered, and it exits 0.
"""

from __future__ import annotations

from asyncrl_jax import cli

import os  # noqa: E402  pylint: disable=wrong-import-position

cli.ensure_cpu_devices(int(os.environ.get("ASYNCRL_CPU_DEVICES", "2")))

# pylint: disable=wrong-import-position
import functools
import signal
import sys
import threading
import time

import jax
from absl import app, flags, logging

from asyncrl_jax import envs, models

from asyncrl_jax.infra import auth
from asyncrl_jax.infra import leave

from asyncrl_jax.infra import sharding
from asyncrl_jax.rl.trajectory import DRAINED
from asyncrl_jax.rollout import registry
from asyncrl_jax.rollout.decode_loop import DecodeServer
from asyncrl_jax.rollout.engine import engine_from_config
from asyncrl_jax.rollout.grpc_service import RolloutService, serve
from asyncrl_jax.weights.remote import WeightReceiver

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
    try:  # where its episodes run model code, the sandbox is checked here, on this machine
      sandboxing = envs.sandbox_status(config)
    except envs.SandboxUnavailable as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    if sandboxing and not sandboxing["sandboxed"]:
      logging.warning("UNSANDBOXED: this decode server runs model-written code with resource limits only "
                      "(env.allow_unsandboxed=True; the sandbox cannot run here: %s); each such call is "
                      "recorded in its turn's info (sandboxed: false)", sandboxing["why"])
    mesh = sharding.make_mesh(jax.local_devices(), config.mesh.rollout.to_dict(), role="mesh.rollout")
    # the run's seed on every server: each request draws from its own stream (its id), wherever it
    # runs; requests without an id's stream (JetStream's insert) get this server's own
    engine = engine_from_config(config, mesh, models.config_of(config), stream_salt=_SERVER_ID.value)
    # No weights until the learner pushes its current version (version -1 accepts any).
    server = DecodeServer(engine, None, version=-1, server_id=_SERVER_ID.value,
                          on_weight_update=config.rollout.on_weight_update,
                          warm_up=config.rollout.warm_up,
                          env_workers=config.env.workers or config.rollout.num_slots,
                          env_timeout=config.env.step_timeout)
    host = config.rollout.host
    service = RolloutService(server, WeightReceiver(f"{host}:0"))
    grpc_server, port = serve(service, host=host, port=config.rollout.port, token=token)
    server.start()
    logging.info("decode server %s on %s:%d (%d devices, %d slots)", _SERVER_ID.value, host, port,
                 len(jax.local_devices()), engine.num_slots)
    done = threading.Event()
    refused: list[str] = []
    if config.rollout.learner_address:
      register = functools.partial(
          registry.register, config.rollout.learner_address, server_id=_SERVER_ID.value,
          address=f"{host}:{port}", model_config=engine.config, tokenizer_id=engine.tokenizer.identity,
          devices=len(jax.local_devices()), mesh=dict(mesh.shape), token=token, sandbox=sandboxing)
      try:
        reply = register(timeout=config.rollout.register_timeout)
      except registry.RegistrationRefused as e:
        logging.error("the learner refused this decode server: %s", e)
        grpc_server.stop(grace=0)
        server.stop()
        sys.exit(1)
      logging.info("registered with the learner at %s (%d servers so far)",
                   config.rollout.learner_address, reply.registered)
      threading.Thread(target=_keep_registered, daemon=True, name="register",
                       args=(register, reply.incarnation, config.rollout.register_interval, done,
                             refused)).start()
    if _PORT_FILE.value:
      tmp = _PORT_FILE.value + ".tmp"
      with open(tmp, "w") as f:
        f.write(str(port))
      os.replace(tmp, _PORT_FILE.value)
    signalled = []
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, lambda signum, _: (signalled.append(signum), done.set()))
    failed = False
    while not done.wait(1.0):
      if server.error is not None:
        logging.error("decode server failed: %r", server.error)
        failed = True
        break
    if signalled:
      _drain(service, config.rollout.drain_timeout)
    grpc_server.stop(grace=2).wait()
    server.stop()
    if service.duplicated:
      logging.warning("sent %d trajectories twice (ASYNCRL_FAULT_DUPLICATES)", service.duplicated)
    # Everything was delivered: exit without interpreter shutdown, where the weight receiver's
    # native threads can abort the process ("terminate called ... exception not rethrown").
    leave.now(1 if failed or refused else 0)

  app.run(_main, argv=argv, flags_parser=cli.parse_flags)


def _keep_registered(register, incarnation: int, interval: float, done: threading.Event,
                     refused: list) -> None:
  """Repeats the registration every ``interval`` seconds until ``done``; a learner that is down is
  waited for (logged once), one that refuses this server stops it."""
  unreachable = False
  while not done.wait(interval):
    try:
      reply = register(timeout=interval, learner_incarnation=incarnation)
    except registry.RegistrationRefused as e:
      logging.error("the learner refused this decode server: %s", e)
      refused.append(str(e))
      done.set()
      return
    except Exception as e:  # pylint: disable=broad-except
      if not unreachable:
        logging.warning("the learner is unreachable (%r); registering again every %gs", e, interval)
      unreachable = True
      continue
    if reply.incarnation != incarnation:
      logging.warning("registered with a new learner (incarnation %d, was %d)", reply.incarnation,
                      incarnation)
    incarnation, unreachable = reply.incarnation, False


def _drain(service: RolloutService, timeout: float) -> None:
  """Gives the queue back, lets the sequences in flight finish for at most ``timeout`` seconds, gives
  the rest back, and waits (a few seconds) until every trajectory was delivered and the learner
  has seen that this server is draining."""
  t = time.time()
  queued = service.drain()
  server = service.server
  logging.info("SIGTERM: draining (%d queued requests given back, %d in flight)", queued,
               server.num_active)
  while server.num_active and time.time() - t < timeout and server.error is None:
    time.sleep(0.05)
  cut = server.abort_active(DRAINED)
  deadline = time.time() + 5.0
  while (server.num_active or not service.delivered()) and time.time() < deadline:
    time.sleep(0.05)
  service.drain_noticed.wait(5.0)  # the learner's next health check: it drops this server as drained
  logging.info("drained in %.1fs (%d sequences cut short and given back%s)", time.time() - t, cut,
               "" if service.delivered() else "; some trajectories were not acknowledged")


if __name__ == "__main__":
  main()

"""How the learner learns of its decode servers: each one registers with learner process 0.

A decode server, once serving, calls ``Register`` on the learner's registry (``rollout.learner_address``)
with its rollout address, its model config, its tokenizer id and its devices. The registry refuses a
server whose model config or tokenizer differs from the learner's, naming every differing field with
both values; the server then exits with that message. A server that registers again under the same id
(restarted, perhaps at another address) replaces its old entry, so a restarted server can rejoin.

A server repeats its registration every ``rollout.register_interval`` seconds, naming the learner
incarnation that accepted it last. A repeat to the same learner from the same address changes nothing;
one that the learner has not seen (a learner restarted from its checkpoint, or one that dropped the
server, e.g. after a stall: ``forget``) is a new registration, so the learner (re)attaches to decode
servers that outlived it, and a server it gave up on rejoins with the current weights.

Servers bind and the registry listens on 127.0.0.1 unless configured otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Optional

import grpc

from asyncrl_jax.infra import auth
from asyncrl_jax.rollout import protocol
from asyncrl_jax.rollout.grpc_service import serve

M = protocol.MESSAGES
log = logging.getLogger(__name__)


class RegistrationRefused(RuntimeError):
  """The learner refused this decode server (its message names the mismatch)."""


@dataclasses.dataclass(frozen=True)
class Registered:
  server_id: str
  address: str
  devices: int
  mesh: dict
  registered_at: float
  sandbox: dict = dataclasses.field(default_factory=dict)  # envs.sandbox_status there ({}: runs no model code)


def model_config_json(model_config) -> str:
  """A model config (dataclass) as the JSON that registration compares."""
  return json.dumps(dataclasses.asdict(model_config), sort_keys=True, default=str)


def mismatches(server: dict, learner: dict) -> list[str]:
  """``field=server value (server) vs learner value (learner)`` for every field that differs."""
  return [f"{k}={server.get(k)!r} (server) vs {learner.get(k)!r} (learner)"
          for k in sorted(set(server) | set(learner)) if server.get(k) != learner.get(k)]


class Registry:
  """Learner side: the decode servers registered so far, checked against the learner's model config
  and tokenizer."""

  def __init__(self, model_config, tokenizer_id: str, incarnation: int = 0):
    self.model = json.loads(model_config_json(model_config))
    self.tokenizer_id = tokenizer_id
    self.incarnation = incarnation  # the learner's (``RolloutRequest.incarnation``)
    self._servers: dict[str, Registered] = {}
    self._changed = threading.Condition()

  def Register(self, request, context):  # pylint: disable=invalid-name
    who = f"decode server {request.server_id!r} at {request.address}"
    try:
      model = json.loads(request.model_config_json)
    except ValueError:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{who}: model config is not JSON")
    problems = mismatches(model, self.model)
    if problems:
      context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                    f"{who}: model config differs from the learner's: {'; '.join(problems)}")
    if request.tokenizer_id != self.tokenizer_id:
      context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                    f"{who}: tokenizer {request.tokenizer_id!r} (server) vs {self.tokenizer_id!r} (learner)")
    if not request.server_id or not request.address:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{who}: server id and address are required")
    try:
      sandbox = json.loads(request.sandbox_json or "{}")
      if not isinstance(sandbox, dict):
        raise ValueError
    except ValueError:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{who}: sandbox state is not a JSON object")
    with self._changed:
      known = self._servers.get(request.server_id)
      if not (known is not None and known.address == request.address
              and request.learner_incarnation == self.incarnation):
        self._servers[request.server_id] = Registered(
            request.server_id, request.address, request.devices,
            json.loads(request.mesh_json or "{}"), time.time(), sandbox)
        if sandbox and not sandbox.get("sandboxed", True):
          log.warning("%s runs model-written code UNSANDBOXED (resource limits only): %s", who,
                      sandbox.get("why", "no reason given"))
        self._changed.notify_all()
      return M["RegisterReply"](registered=len(self._servers), incarnation=self.incarnation)

  def forget(self, server_id: str, address: str) -> None:
    """Drops the entry of ``server_id`` at ``address`` (the learner gave up on it): its next
    registration is a new one."""
    with self._changed:
      known = self._servers.get(server_id)
      if known is not None and known.address == address:
        del self._servers[server_id]

  def servers(self) -> list[Registered]:
    with self._changed:
      return sorted(self._servers.values(), key=lambda s: s.server_id)

  def wait_for(self, n: int, timeout: float, *, alive=lambda: True) -> list[Registered]:
    """Blocks until ``n`` servers have registered; raises TimeoutError naming who has after
    ``timeout`` seconds (or as soon as ``alive()`` turns false)."""
    deadline = time.time() + timeout
    with self._changed:
      while len(self._servers) < n:
        left = deadline - time.time()
        if left <= 0 or not alive():
          have = ", ".join(f"{s.server_id} at {s.address}" for s in self._servers.values()) or "none"
          raise TimeoutError(f"{len(self._servers)} of {n} decode servers registered within "
                             f"{timeout:.0f}s ({have})")
        self._changed.wait(min(left, 1.0))
      return sorted(self._servers.values(), key=lambda s: s.server_id)

  def serve(self, host: str = "127.0.0.1", port: int = 0, token: Optional[str] = None
            ) -> tuple[grpc.Server, int]:
    return serve(self, host=host, port=port, max_workers=4, methods=protocol.LEARNER_METHODS,
                 name=protocol.LEARNER_SERVICE, token=token)


def register(learner_address: str, *, server_id: str, address: str, model_config, tokenizer_id: str,
             devices: int, mesh: Optional[dict] = None, timeout: float = 600.0,
             token: Optional[str] = None, learner_incarnation: int = 0, sandbox: Optional[dict] = None):
  """Registers this decode server with the learner at ``learner_address``, waiting up to ``timeout``
  seconds for the learner to come up; returns the reply (``registered``: servers registered so far;
  ``incarnation``: the learner's, to name in the next registration). ``sandbox``: how this server runs
  model-written code (``envs.sandbox_status``; None where it runs none), which the learner records
  for the run's summary. Raises ``RegistrationRefused`` with the learner's reason on a mismatch."""
  with auth.channel(learner_address, token, protocol.GRPC_OPTIONS) as channel:
    try:
      grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError as e:
      raise TimeoutError(f"no learner registry at {learner_address} within {timeout:.0f}s") from e
    call = channel.unary_unary(f"/{protocol.LEARNER_SERVICE}/Register",
                               request_serializer=M["RegisterRequest"].SerializeToString,
                               response_deserializer=M["RegisterReply"].FromString)
    request = M["RegisterRequest"](server_id=server_id, address=address,
                                   model_config_json=model_config_json(model_config),
                                   tokenizer_id=tokenizer_id, devices=devices,
                                   mesh_json=json.dumps(mesh or {}),
                                   learner_incarnation=learner_incarnation,
                                   sandbox_json=json.dumps(sandbox) if sandbox else "")
    try:
      return call(request, timeout=max(min(timeout, 60.0), 1.0))
    except grpc.RpcError as e:
      if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
        raise RegistrationRefused(e.details()) from e
      raise

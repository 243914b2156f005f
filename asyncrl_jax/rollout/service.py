"""gRPC streaming service around a ``DecodeServer`` (protobuf only; see ``protocol.py``) and its client.

* ``Submit``: queue rollout requests.
* ``Stream``: server-streams finished trajectories as they complete; ends after ``max_trajectories``
  (0: until the client cancels or its deadline passes). Delivery is at-least-once: a trajectory in
  flight when a stream breaks is queued again, so consumers drop duplicates by ``trajectory_id``.
* ``UpdateWeights``: pull version ``v`` from the learner's transfer server and switch to it
  (in-flight sequences are interrupted and resumed under the new weights).
* ``Abort``, ``Health``.

Servers bind 127.0.0.1 unless another host is configured.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent import futures
from typing import Iterator, Optional, Sequence

import grpc

from asyncrl_jax.rollout import protocol
from asyncrl_jax.rollout.server import DecodeServer
from asyncrl_jax.rollout.trajectory import RolloutRequest, Trajectory
from asyncrl_jax.transfer import WeightReceiver

log = logging.getLogger(__name__)
M = protocol.MESSAGES


class RolloutService:
  """Implements the RPCs over one DecodeServer (whose finished trajectories it takes over)."""

  def __init__(self, server: DecodeServer, receiver: Optional[WeightReceiver] = None):
    self.server = server
    self.receiver = receiver
    self.outbox: "queue.Queue[Trajectory]" = queue.Queue()
    server.stream_to(self.outbox.put)
    self._weights_lock = threading.Lock()

  def Submit(self, request, context):
    try:
      requests = [protocol.request_from_pb(r) for r in request.requests]
    except ValueError as e:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    self.server.submit(*requests)
    return M["SubmitReply"](accepted=len(requests))

  def Stream(self, request, context) -> Iterator:
    sent, limit = 0, request.max_trajectories
    while context.is_active() and (limit <= 0 or sent < limit):
      try:
        t = self.outbox.get(timeout=0.2)
      except queue.Empty:
        if self.server.error is not None:
          context.abort(grpc.StatusCode.INTERNAL, f"decode server failed: {self.server.error!r}")
        continue
      if not context.is_active():
        self.outbox.put(t)  # the client went away: keep it for the next stream
        break
      try:
        yield protocol.trajectory_to_pb(t)
      except GeneratorExit:
        self.outbox.put(t)  # possibly undelivered: deliver again (consumers dedupe by id)
        raise
      sent += 1

  def UpdateWeights(self, request, context):
    if self.receiver is None:
      context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this server has no weight receiver")
    with self._weights_lock:
      if request.version <= self.server.version:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"version {request.version} is not newer than {self.server.version}")
      params, stats = self.receiver.pull(request.address, request.uuid, self.server.current_params)
      self.server.update_weights(params, request.version)
    log.info("pulled weights v%d: %.1f MB in %.3f s", request.version, stats.bytes / 1e6,
             stats.seconds)
    return M["WeightsReply"](version=request.version, seconds=stats.seconds, bytes=stats.bytes)

  def Abort(self, request, context):
    self.server.abort(request.request_id)
    return M["Empty"]()

  def Health(self, request, context):
    s = self.server
    return M["HealthReply"](status="error" if s.error else "serving", version=s.version,
                            active=s.num_active, queued=s.num_queued, tokens=s.stats["tokens"],
                            server_id=s.server_id, error=repr(s.error) if s.error else "")


def _handlers(service: RolloutService) -> grpc.GenericRpcHandler:
  table = {}
  for name, (req, rep, streaming) in protocol.METHODS.items():
    make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
    table[name] = make(getattr(service, name), request_deserializer=M[req].FromString,
                       response_serializer=M[rep].SerializeToString)
  return grpc.method_handlers_generic_handler(protocol.SERVICE, table)


def serve(service: RolloutService, *, host: str = "127.0.0.1", port: int = 0,
          max_workers: int = 16) -> tuple[grpc.Server, int]:
  """Starts the gRPC server; returns it and the bound port."""
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
  server.add_generic_rpc_handlers((_handlers(service),))
  bound = server.add_insecure_port(f"{host}:{port}")
  if not bound:
    raise OSError(f"could not bind {host}:{port}")
  server.start()
  return server, bound


class RolloutClient:
  """Client of one decode server. Every call takes a deadline (seconds)."""

  def __init__(self, address: str):
    self.address = address
    self._channel = grpc.insecure_channel(address)
    self._calls = {}
    for name, (req, rep, streaming) in protocol.METHODS.items():
      make = self._channel.unary_stream if streaming else self._channel.unary_unary
      self._calls[name] = make(f"/{protocol.SERVICE}/{name}", request_serializer=M[req].SerializeToString,
                               response_deserializer=M[rep].FromString)

  def wait_ready(self, timeout: float = 60.0) -> None:
    grpc.channel_ready_future(self._channel).result(timeout=timeout)

  def submit(self, requests: Sequence[RolloutRequest], timeout: float = 30.0) -> int:
    msg = M["SubmitRequest"](requests=[protocol.request_to_pb(r) for r in requests])
    return self._calls["Submit"](msg, timeout=timeout).accepted

  def stream(self, max_trajectories: int = 0, timeout: Optional[float] = None) -> Iterator[Trajectory]:
    """Yields trajectories as they finish; cancel by breaking out of the loop or via the deadline."""
    call = self._calls["Stream"](M["StreamRequest"](max_trajectories=max_trajectories), timeout=timeout)
    try:
      for m in call:
        yield protocol.trajectory_from_pb(m)
    finally:
      call.cancel()

  def update_weights(self, version: int, address: str, uuid: int, timeout: float = 300.0):
    return self._calls["UpdateWeights"](M["WeightsNotice"](version=version, address=address, uuid=uuid),
                                        timeout=timeout)

  def abort(self, request_id: str, timeout: float = 30.0) -> None:
    self._calls["Abort"](M["AbortRequest"](request_id=request_id), timeout=timeout)

  def health(self, timeout: float = 10.0):
    return self._calls["Health"](M["Empty"](), timeout=timeout)

  def close(self) -> None:
    self._channel.close()

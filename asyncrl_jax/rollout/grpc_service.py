"""gRPC streaming service around a ``DecodeServer`` (protobuf only; see ``protocol.py``) and its client.

* ``Submit``: queue rollout requests.
* ``Stream``: server-streams finished trajectories as they complete; ends after ``max_trajectories``
  (0: until the client cancels or its deadline passes).
* ``Ack``: the client confirms receipt. A trajectory sent on a stream that ends (cancelled, deadline,
  client gone) without an ack is queued again, so delivery is at-least-once and consumers drop
  duplicates by ``trajectory_id``. ``RolloutClient.stream`` acks every trajectory on receipt.
* ``UpdateWeights``: pull version ``v`` shard by shard from every learner process's transfer server
  (the notice names each one's blocks) and switch to it (in-flight sequences are interrupted and
  resumed under the new weights). The reply counts the bytes pulled from each learner process.
* ``Abort``, ``Health``.

**Learner incarnations.** Requests and weight notices carry the incarnation of the learner that sent
them (``RolloutRequest.incarnation``). The service serves one at a time: the one whose weights it
holds. A notice from a newer incarnation (a learner restarted from its checkpoint) is accepted at any
version, an older one included, and the work of the previous one is dropped: its queue, its
sequences in flight, and its finished trajectories not yet delivered. Requests and notices from any
other incarnation are refused (``FAILED_PRECONDITION``).

**Draining** (``drain``, on SIGTERM): ``Submit`` is refused (``UNAVAILABLE``), requests not yet started
come back as aborted trajectories, and ``Health`` says ``draining``, so the learner places the work
elsewhere; sequences in flight finish.

Servers bind 127.0.0.1 unless another host is configured.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures
from typing import Iterator, Optional, Sequence

import grpc

from asyncrl_jax.infra import auth

from asyncrl_jax.infra import faults
from asyncrl_jax.rl.trajectory import RolloutRequest, Trajectory
from asyncrl_jax.rollout import protocol
from asyncrl_jax.rollout.decode_loop import DecodeServer
from asyncrl_jax.weights.remote import WeightReceiver

log = logging.getLogger(__name__)
M = protocol.MESSAGES


class RolloutService:
  """Implements the RPCs over one DecodeServer (whose finished trajectories it takes over)."""

  def __init__(self, server: DecodeServer, receiver: Optional[WeightReceiver] = None):
    self.server = server
    self.receiver = receiver
    self.outbox: "queue.Queue[Trajectory]" = queue.Queue()
    server.stream_to(self.outbox.put)
    self._weights_lock = threading.Lock()  # one pull at a time
    self._switch_lock = threading.Lock()  # the incarnation and the server's queue change together
    self._unacked: dict[str, Trajectory] = {}
    self._unacked_lock = threading.Lock()
    self.incarnation = 0  # of the learner whose weights the server holds (0: none named one)
    self.base_id = 0  # the learner's name for the frozen base weights held (LoRA; 0: none)
    self._held = None  # with a base_id: the weights last pulled (whose base the next partial pull keeps)
    self.draining = False
    self.drain_noticed = threading.Event()  # a Health call was answered "draining"
    self.dropped = 0  # finished trajectories of an older incarnation, never delivered
    self.duplicated = 0  # trajectories sent twice on purpose (``faults.duplicate``)

  def drain(self) -> int:
    """Takes no new work from now on; returns how many queued requests went back (aborted)."""
    self.draining = True
    return self.server.drain()

  def Submit(self, request, context):
    if self.draining:
      context.abort(grpc.StatusCode.UNAVAILABLE, "this decode server is draining (shutting down)")
    try:
      requests = [protocol.request_from_pb(r) for r in request.requests]
    except ValueError as e:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    with self._switch_lock:  # (an incarnation change drops the queue: not while this one joins it)
      other = sorted({r.incarnation for r in requests} - {self.incarnation})
      if other:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"requests of learner incarnation {other[0]}: this server serves incarnation "
                      f"{self.incarnation} (a newer learner sends its weights first)")
      self.server.submit(*requests)
    return M["SubmitReply"](accepted=len(requests))

  def Stream(self, request, context) -> Iterator:
    sent: list[str] = []
    limit = request.max_trajectories
    try:
      while context.is_active() and (limit <= 0 or len(sent) < limit):
        try:
          t = self.outbox.get(timeout=0.2)
        except queue.Empty:
          if self.server.error is not None:
            context.abort(grpc.StatusCode.INTERNAL, f"decode server failed: {self.server.error!r}")
          continue
        if t.incarnation != self.incarnation:  # a previous learner's: nobody waits for it
          self.dropped += 1
          continue
        with self._unacked_lock:
          self._unacked[t.trajectory_id] = t
        sent.append(t.trajectory_id)
        yield protocol.trajectory_to_pb(t)
        if faults.duplicate():  # (fault injection: an at-least-once stream's repeat)
          self.duplicated += 1
          yield protocol.trajectory_to_pb(t)
      deadline = time.time() + 2.0  # finished normally: give the client a moment to ack the last ones
      while context.is_active() and time.time() < deadline and self._any_unacked(sent):
        time.sleep(0.01)
    finally:
      self._requeue_unacked(sent)

  def _any_unacked(self, ids) -> bool:
    with self._unacked_lock:
      return any(i in self._unacked for i in ids)

  def _requeue_unacked(self, ids) -> None:
    with self._unacked_lock:
      lost = [self._unacked.pop(i) for i in ids if i in self._unacked]
    for t in lost:
      self.outbox.put(t)

  def Ack(self, request, context):
    with self._unacked_lock:
      for i in request.trajectory_ids:
        self._unacked.pop(i, None)
    return M["Empty"]()

  def UpdateWeights(self, request, context):
    if self.receiver is None:
      context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this server has no weight receiver")
    with self._weights_lock:
      restart = request.incarnation > self.incarnation
      if request.incarnation < self.incarnation:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"weights v{request.version} from learner incarnation {request.incarnation}, "
                      f"older than the one served ({self.incarnation})")
      if request.version <= self.server.version and not restart:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"version {request.version} is not newer than {self.server.version}")
      try:
        sources = protocol.sources_from_pb(request.sources)
      except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"weights v{request.version}: {e}")
      keep = None
      if request.partial:  # the adapters alone: the rest is the frozen base this server holds
        keep = self._held  # (the newest pulled: the server may not have switched to it yet)
        if not request.base_id or request.base_id != self.base_id or keep is None:
          context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                        f"weights v{request.version} are adapters for base {request.base_id}, but this "
                        f"server holds base {self.base_id or 'none'}: it needs the full weights")
      try:
        params, stats = self.receiver.pull(sources, self.server.engine.param_spec(), keep=keep)
      except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"weights v{request.version}: {e}")
      except Exception as e:  # pylint: disable=broad-except
        # e.g. a learner process died mid-pull ("Connection closed"): nothing of v is used, the
        # server keeps decoding with the weights it has, and the learner may retry under a new uuid
        for src in sources:
          self.receiver.forget(src.address)
        context.abort(grpc.StatusCode.UNAVAILABLE, f"pull of weights v{request.version} failed: {e!r}")
      # all of it arrived: swap it in whole
      with self._switch_lock:
        self.server.update_weights(params, request.version, restart=restart)
        self.base_id = request.base_id
        self._held = params if request.base_id else None
        if restart:
          if self.incarnation:
            log.warning("learner incarnation %d replaces %d: its work is dropped; serving v%d",
                        request.incarnation, self.incarnation, request.version)
          self.incarnation = request.incarnation
    log.info("pulled weights v%d%s: %.1f MB from %d learner processes in %.3f s", request.version,
             " (adapters)" if request.partial else "", stats.bytes / 1e6, len(sources), stats.seconds)
    return M["WeightsReply"](version=request.version, seconds=stats.seconds, bytes=stats.bytes,
                             source_bytes=stats.per_source)

  def Abort(self, request, context):
    self.server.abort(request.request_id)
    return M["Empty"]()

  def Health(self, request, context):
    s = self.server
    status = ("error" if s.error else "draining" if self.draining
              else "warming_up" if s.engine.compiles_pending() else "serving")
    if status == "draining":
      self.drain_noticed.set()
    return M["HealthReply"](status=status, version=s.version,
                            active=s.num_active, queued=s.num_queued, server_id=s.server_id,
                            error=repr(s.error) if s.error else "", incarnation=self.incarnation,
                            stats=protocol.stats_to_pb(s.stats.copy()))

  def delivered(self) -> bool:
    """Every finished trajectory was sent and acknowledged (nothing in the outbox or unacked)."""
    with self._unacked_lock:
      return self.outbox.empty() and not self._unacked


def _handlers(service, methods: dict, name: str) -> grpc.GenericRpcHandler:
  table = {}
  for method, (req, rep, streaming) in methods.items():
    make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
    table[method] = make(getattr(service, method), request_deserializer=M[req].FromString,
                         response_serializer=M[rep].SerializeToString)
  return grpc.method_handlers_generic_handler(name, table)


def serve(service, *, host: str = "127.0.0.1", port: int = 0, max_workers: int = 16,
          methods: dict = protocol.METHODS, name: str = protocol.SERVICE,
          token: Optional[str] = None) -> tuple[grpc.Server, int]:
  """Starts a gRPC server for ``service`` (the rollout service unless ``methods``/``name`` say
  otherwise); returns it and the bound port. A non-loopback ``host`` needs a ``token``, which every
  call must then carry (``auth``); messages over ``protocol.MAX_MESSAGE_BYTES`` are refused."""
  auth.require(host, token, "the gRPC server's host")
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                       interceptors=auth.server_interceptors(token), options=protocol.GRPC_OPTIONS)
  server.add_generic_rpc_handlers((_handlers(service, methods, name),))
  bound = server.add_insecure_port(f"{host}:{port}")
  if not bound:
    raise OSError(f"could not bind {host}:{port}")
  server.start()
  return server, bound


class RolloutClient:
  """Client of one decode server. Every call takes a deadline (seconds)."""

  def __init__(self, address: str, token: Optional[str] = None):
    self.address = address
    self._channel = auth.channel(address, token, protocol.GRPC_OPTIONS)
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
        t = protocol.trajectory_from_pb(m)
        self._calls["Ack"](M["AckRequest"](trajectory_ids=[t.trajectory_id]), timeout=30)
        yield t
    finally:
      call.cancel()

  def update_weights(self, version: int, sources, timeout: float = 300.0, incarnation: int = 0,
                     base_id: int = 0, partial: bool = False):
    """Tells the server to pull ``version`` from ``sources`` (``transfer.remote.Source``, one per
    learner process; with ``partial``, the adapters alone, over the base ``base_id`` it holds);
    returns its ``WeightsReply`` once it holds the new weights."""
    notice = M["WeightsNotice"](version=version, sources=protocol.sources_to_pb(sources),
                                incarnation=incarnation, base_id=base_id, partial=int(partial))
    return self._calls["UpdateWeights"](notice, timeout=timeout)

  def abort(self, request_id: str, timeout: float = 30.0) -> None:
    self._calls["Abort"](M["AbortRequest"](request_id=request_id), timeout=timeout)

  def health(self, timeout: float = 10.0):
    return self._calls["Health"](M["Empty"](), timeout=timeout)

  def close(self) -> None:
    self._channel.close()

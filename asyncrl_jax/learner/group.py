"""The learner's processes acting as one: process 0 leads, the others follow.

Design: **one controller**, on learner process 0. It owns the prompt stream, admission, rewards and
batches, the run log and the decode servers' registry, exactly as in a single-process run; the other
learner processes own no data and make no decisions. Every step that needs all of them (an update, a
weight offer, a checkpoint save, an evaluation, the stop) is an *op* that process 0 broadcasts (``jax``'s
``broadcast_one_to_all``) and every process then runs; each process puts only its own rows of every
micro-batch on device (``update.Updater.place``), and offers only its own blocks of the weights.

Why one controller rather than one per process with its own prompt shard: admission, the staleness
bound, batch order and resume stay exactly those of a single process (the trained prompts for a
seed are the single-process run's by construction, not by an argument about interleaved shards);
metrics and the summary need no merging; a decode server registers in one place; and the number of
decode servers need not be a multiple of the learner processes. The cost is that process 0 sends every
batch to every process (a few MB per version here; a row-wise scatter is the refinement if that
ever shows in the profile).

With one process the group is just the learner: every op runs locally and nothing is broadcast.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from typing import Callable, Optional, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from asyncrl_jax.infra import faults
from asyncrl_jax.learner.publisher import WeightPublisher
from asyncrl_jax.rl.batching import SequenceData

log = logging.getLogger(__name__)

TRAIN, OFFER, SAVE, STOP, CHECK, EVAL = 1, 2, 3, 4, 5, 6
_OPS = {TRAIN: "train", OFFER: "offer", SAVE: "save", STOP: "stop", CHECK: "check", EVAL: "evaluate"}
_ADDRESS_BYTES = 256


def pack_sequences(sequences: Sequence[SequenceData]) -> dict:
  """A batch as flat arrays (no pickling): lengths, int32 tokens/versions, float32 per-token fields
  (mask, behaviour log-prob, advantage, and, when any sequence has either, loss weight and stop-token
  ban)."""
  optional = any(s.loss_weight is not None or s.eos_banned is not None for s in sequences)
  cat = lambda f: np.concatenate([np.asarray(f(s)) for s in sequences]) if sequences else np.zeros(0)
  floats = [cat(lambda s: s.mask), cat(lambda s: s.behav_logp), cat(lambda s: s.advantages)]
  if optional:
    floats.append(cat(lambda s: s.loss_weight if s.loss_weight is not None else np.ones(len(s.tokens))))
    floats.append(cat(lambda s: s.eos_banned if s.eos_banned is not None else np.zeros(len(s.tokens))))
  out = {"lengths": np.asarray([len(s.tokens) for s in sequences], np.int32),
         "tokens": cat(lambda s: s.tokens).astype(np.int32),
         "versions": cat(lambda s: s.versions).astype(np.int32),
         "floats": np.stack(floats).astype(np.float32)}
  if sequences and sequences[0].routes is not None:  # [tokens, L_moe * k] (int32: broadcast as is)
    out["routes"] = np.concatenate([np.asarray(s.routes).reshape(len(s.tokens), -1)
                                    for s in sequences]).astype(np.int32)
  return out


def unpack_sequences(arrays: dict, route_shape: Optional[tuple] = None) -> list[SequenceData]:
  """``pack_sequences``' inverse; ``route_shape`` (L_moe, k): the routes' per-token shape."""
  bounds = np.cumsum(np.r_[0, np.asarray(arrays["lengths"])])
  floats = np.asarray(arrays["floats"])
  routes = arrays.get("routes")
  out = []
  for a, b in zip(bounds[:-1], bounds[1:]):
    out.append(SequenceData(tokens=np.asarray(arrays["tokens"][a:b]), mask=floats[0, a:b],
                            behav_logp=floats[1, a:b], advantages=floats[2, a:b],
                            versions=np.asarray(arrays["versions"][a:b]),
                            loss_weight=floats[3, a:b] if len(floats) > 3 else None,
                            eos_banned=floats[4, a:b] if len(floats) > 4 else None,
                            routes=None if routes is None else
                            np.asarray(routes[a:b]).reshape(b - a, *route_shape).astype(np.int16)))
  return out


def _encode(text: str) -> np.ndarray:
  raw = text.encode()
  if len(raw) > _ADDRESS_BYTES:
    raise ValueError(f"address {text!r} is longer than {_ADDRESS_BYTES} bytes")
  return np.frombuffer(raw.ljust(_ADDRESS_BYTES, b"\0"), np.uint8)


class LearnerGroup:
  """The learner (this process's part of it), and the ops every learner process runs together.

  ``transfer_host``: where this process's weight sender listens (None: no remote decode servers, so
  no sender).
  """

  def __init__(self, learner, checkpointer, *, transfer_host: Optional[str] = None):
    self.learner = learner
    self.stop_requested = threading.Event()  # this process got SIGTERM (``install_sigterm``)
    self.agreed_stop = False  # the learner processes agreed to stop (some process got SIGTERM)
    self.ckpt = checkpointer
    self.processes = jax.process_count()
    self.is_leader = jax.process_index() == 0
    # what every process runs for an ``evaluate`` op (a follower's; process 0 passes its own)
    self.on_evaluate: Optional[Callable[[], object]] = None
    self.publisher: Optional[WeightPublisher] = None  # remote decode servers only
    if transfer_host is not None:
      self.publisher = WeightPublisher(learner, transfer_host, processes=self.processes,
                                       gather=self._gather_addresses, offer_op=self.offer)

  def _gather_addresses(self, mine: str) -> list[str]:
    if self.processes == 1:
      return [mine]
    rows = np.asarray(multihost_utils.process_allgather(_encode(mine)))
    return [bytes(r).rstrip(b"\0").decode() for r in rows]

  # ------------------------------------------------------------------ ops (process 0 calls these)

  def _broadcast(self, op: int, version: int, payload: Optional[dict] = None, sizes=()) -> None:
    """The op's header (op, version, up to 3 sizes the followers allocate by), then its payload."""
    header = np.zeros(5, np.int32)
    header[:2 + len(sizes)] = [op, version, *sizes]
    multihost_utils.broadcast_one_to_all(header)
    if payload:
      multihost_utils.broadcast_one_to_all(payload)

  def train(self, sequences: Sequence[SequenceData], *, version: int) -> dict:
    if self.processes > 1:  # (one process: no copy of the batch is made)
      packed = pack_sequences(sequences)
      self._broadcast(TRAIN, version, packed,
                      (len(packed["lengths"]), len(packed["tokens"]), len(packed["floats"])))
    return self.learner.train(sequences, version=version)

  def offer(self, version: int, uuids: Sequence[int], partial: Sequence[bool] = ()) -> None:
    """The publisher's offer as an op: every learner process offers its blocks of the current weights
    (``WeightPublisher.offer_here``; ``partial[i]``: the adapters alone for uuid ``i``); returns once
    all have (so that a receiver told of the version finds every source ready)."""
    flags = list(partial) or [False] * len(uuids)
    if self.processes > 1:  # (as uint32 halves: without jax_enable_x64 a broadcast int64 is cut to 32 bits)
      data = (np.concatenate([np.asarray(uuids, np.uint64).view(np.uint32), np.asarray(flags, np.uint32)])
              if uuids else None)
      self._broadcast(OFFER, version, {"data": data} if uuids else None, (len(uuids),))
    self._offer(version, uuids, flags)

  def save(self, meta: dict) -> None:
    """Every process saves its part of the state at the learner's version; ``meta`` goes in the
    checkpoint once (Orbax writes JSON from process 0 only, but every process passes the same)."""
    if self.processes > 1:
      data = np.frombuffer(json.dumps(meta).encode(), np.uint8)
      self._broadcast(SAVE, self.learner.version, {"data": data}, (len(data),))
    self.ckpt.save(self.learner.version, state=self.learner.checkpoint_state(), meta=meta)

  def evaluate(self, run: Callable[[], object]):
    """Every learner process runs a held-out evaluation together (``run`` here, ``on_evaluate`` in
    the others: the same collective steps); returns ``run``'s result."""
    if self.processes > 1:
      self._broadcast(EVAL, self.learner.version)
    return run()

  def share_token_lists(self, lists: Optional[Sequence]) -> list[np.ndarray]:
    """Process 0's ``lists`` (int token sequences, e.g. the held-out prompts) in every process; the
    others pass None. Not an op: every process calls it at the same point of its setup."""
    if self.processes == 1:
      return [np.asarray(x, np.int32) for x in lists]
    if self.is_leader:
      sizes = np.asarray([len(x) for x in lists], np.int32)
      flat = np.concatenate([np.asarray(x, np.int32) for x in lists]) if len(lists) else np.zeros(0, np.int32)
      header = np.asarray([len(sizes), len(flat)], np.int32)
    else:
      header = np.zeros(2, np.int32)
    n, total = (int(x) for x in multihost_utils.broadcast_one_to_all(header))
    if not self.is_leader:
      sizes, flat = np.zeros(n, np.int32), np.zeros(total, np.int32)
    got = multihost_utils.broadcast_one_to_all({"sizes": sizes, "flat": flat})
    bounds = np.cumsum(np.r_[0, np.asarray(got["sizes"])])
    flat = np.asarray(got["flat"], np.int32)
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

  def stop(self) -> None:
    if self.processes > 1:
      self._broadcast(STOP, self.learner.version)

  def install_sigterm(self) -> None:
    """SIGTERM (a preemption notice) no longer kills this process: it sets ``stop_requested``, and
    the run stops at the next ``should_stop``."""
    signal.signal(signal.SIGTERM, lambda *_: self.stop_requested.set())
    signal.siginterrupt(signal.SIGTERM, False)  # native threads' system calls restart, not fail

  def should_stop(self) -> bool:
    """Whether any learner process got SIGTERM: every process learns the same answer (one broadcast
    and one all-gather of a flag), so they all stop at the same version."""
    if self.processes == 1:
      return self.stop_requested.is_set()
    self._broadcast(CHECK, self.learner.version)
    return self._any_stop()

  def _any_stop(self) -> bool:
    flags = multihost_utils.process_allgather(np.int32(self.stop_requested.is_set()))
    self.agreed_stop = bool(np.asarray(flags).any())
    return self.agreed_stop

  # ------------------------------------------------------------------ both sides

  def _offer(self, version: int, uuids: Sequence[int], partial: Sequence[bool] = ()) -> None:
    if self.publisher is not None:
      self.publisher.offer_here(version, uuids, partial)
    if self.processes > 1:
      multihost_utils.sync_global_devices(f"offered v{version}")

  def follow(self) -> None:
    """Processes other than 0: run the ops process 0 broadcasts, until it stops."""
    while True:
      op, version, a, b, c = (int(x) for x in multihost_utils.broadcast_one_to_all(np.zeros(5, np.int32)))
      log.info("op %s at version %d", _OPS.get(op, op), version)
      if op == TRAIN:
        faults.at("train", version)
        like = {"lengths": np.zeros(a, np.int32), "tokens": np.zeros(b, np.int32),
                "versions": np.zeros(b, np.int32), "floats": np.zeros((c, b), np.float32)}
        route_shape = self.learner.settings.route_shape  # (the same config in every process)
        if route_shape is not None and a:
          like["routes"] = np.zeros((b, int(np.prod(route_shape))), np.int32)
        self.learner.train(unpack_sequences(multihost_utils.broadcast_one_to_all(like), route_shape),
                           version=version)
      elif op == OFFER:
        like = {"data": np.zeros(3 * a, np.uint32)}
        data = np.asarray(multihost_utils.broadcast_one_to_all(like)["data"], np.uint32) if a else None
        uuids = [int(u) for u in data[:2 * a].view(np.uint64)] if a else []
        self._offer(version, uuids, [bool(f) for f in data[2 * a:]] if a else [])
      elif op == SAVE:
        data = multihost_utils.broadcast_one_to_all({"data": np.zeros(a, np.uint8)})["data"]
        self.learner.check_version(version, "the checkpoint")
        self.ckpt.save(version, state=self.learner.checkpoint_state(),
                       meta=json.loads(bytes(np.asarray(data)).decode()))
      elif op == CHECK:
        faults.at("sigterm", version)
        self._any_stop()
      elif op == EVAL:
        self.learner.check_version(version, "the evaluation")
        if self.on_evaluate is None:
          raise RuntimeError(f"learner process {jax.process_index()}: an evaluation from process 0, "
                             "but this process has no evaluation set up (learner.eval_every differs?)")
        self.on_evaluate()
      elif op == STOP:
        return
      else:
        raise RuntimeError(f"learner process {jax.process_index()}: unknown op {op} from process 0")

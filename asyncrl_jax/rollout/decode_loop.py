"""The decode server: continuous batching over the engine, per-token versions, interruptible updates.

One loop owns the engine's decode state. Each iteration:

1. applies new weights if a newer version was published: every in-flight sequence is interrupted, its
   KV cache discarded and recomputed from prompt + tokens so far under the new weights (``refill``),
   and decoding continues; the trajectory keeps the version of every token. With
   ``on_weight_update="keep_cache"`` the re-prefill is skipped: decoding continues under the new weights
   on the KV cache the older ones wrote (cheaper; each later token is then drawn from a distribution
   that no single version defines, and its recorded log-prob is that distribution's, which is what the
   behaviour policy of the importance weights must be). With ``on_weight_update="drain"`` (the
   non-interruptible baseline of AReaL's ablation) the new weights wait: the sequences in flight finish
   under the old ones, no new sequence starts meanwhile, and the weights apply once every slot is free;
2. fills free slots from the request queue at once (prefill + insert), so slots stay busy;
3. runs one decode step for all slots and records each sampled token with its log-prob and version;
4. finishes sequences that emitted a stop token or reached their length cap and streams them out
   (``on_trajectory`` callback, or the ``finished`` queue).

A request with an ``episode`` runs a multi-turn episode in its slot (``episodes``): at the end of each
action the slot parks while its environment steps on a worker, the other slots decode on, and the
observation is appended to the slot's cache (``Engine.extend``) before decoding resumes. A weight
update re-prefills a parked episode's context too, observations included.

Requests that cannot be served as asked (prompt longer than the engine's prefill limit, or prompt +
``max_new_tokens`` beyond the cache) finish at once with ``finish_reason="error"`` and a message: nothing
is silently truncated. ``abort(id)`` finishes a request with the tokens generated so far.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

import jax
import numpy as np

from asyncrl_jax.rl.trajectory import DRAINED, RolloutRequest, Trajectory
from asyncrl_jax.envs.pool import EnvironmentPool
from asyncrl_jax.rollout.engine import Engine, sampling_stream
from asyncrl_jax.rollout.episodes import Episodes, Finish, Started
from asyncrl_jax.rollout.inflight import InFlight
from asyncrl_jax.rollout.stats import DecodeStats

log = logging.getLogger(__name__)

ON_WEIGHT_UPDATE = ("recompute", "keep_cache", "drain")


class DecodeServer:
  """Runs generation on one engine; thread-safe ``submit`` / ``update_weights`` / ``abort``.

  Args:
    engine: the JetStream engine (its mesh, slots and sampling settings).
    params: initial parameters (any placement; they are put on the engine's sharding), or None: the
      server then holds no weights, and requests wait in the queue until the first ``update_weights``.
    version: their policy version.
    server_id: recorded in every trajectory.
    on_trajectory: called (from the loop thread) with each finished trajectory; if None they are put on
      ``self.finished``.
    on_weight_update: ``"recompute"`` (default: re-prefill every in-flight sequence under the new
      weights), ``"keep_cache"`` (continue on the existing KV cache) or ``"drain"`` (finish the
      sequences in flight under the old weights, then switch), see above.
    steps_per_call: most decode steps fused into one device call. A call ends early, after the step in
      which any busy slot finishes, so freed slots are refilled promptly; when nothing finishes, long
      calls amortise dispatch and host round trips. A weight update takes effect at the next call
      boundary, so this also bounds how many tokens the old weights produce after an update.
    warm_up: start compiling every batched-prefill shape in the background now (``Engine.warm_up``).
    transfer_guard: ``jax.transfer_guard`` level of the loop's thread (``"disallow"``: implicit
      transfers raise and fail the server; ``"log"`` to find them; ``"allow"``).
    environments: the worker pool that steps episodes' environments (default: one of
      ``env_workers`` workers and an ``env_timeout`` per step, made at the first episode).
  """

  def __init__(self, engine: Engine, params, *, version: int = 0, server_id: str = "decode-0",
               on_trajectory: Optional[Callable[[Trajectory], None]] = None, steps_per_call: int = 16,
               on_weight_update: str = "recompute", warm_up: bool = False,
               transfer_guard: str = "disallow", environments: Optional[EnvironmentPool] = None,
               env_workers: int = 8, env_timeout: float = 60.0):
    if steps_per_call < 1:
      raise ValueError(f"steps_per_call={steps_per_call} must be >= 1")
    if on_weight_update not in ON_WEIGHT_UPDATE:
      raise ValueError(f"on_weight_update={on_weight_update!r} must be one of {ON_WEIGHT_UPDATE}")
    self.on_weight_update = on_weight_update
    self.transfer_guard = transfer_guard
    self.steps_per_call = steps_per_call
    self.engine = engine
    self.server_id = server_id
    self.finished: "queue.Queue[Trajectory]" = queue.Queue()
    self._emit = on_trajectory or self.finished.put
    self._params = engine.place_params(params) if params is not None else None
    self.version = version
    self._pending: Optional[tuple] = None
    self._requests: "collections.deque[RolloutRequest]" = collections.deque()
    self._aborts: dict[str, str] = {}  # request id -> why
    self._lock = threading.Lock()
    self._wake = threading.Condition(self._lock)
    self._slots: list[Optional[InFlight]] = [None] * engine.num_slots
    self._inflight: Optional[tuple] = None  # (tokens, logp, slot occupants, version) of a launched chunk
    self._drain_started: Optional[float] = None  # when held weights began waiting (drain mode)
    # finished trajectories waiting for their routes (``engine.record_routes``): (trajectory, the
    # slot's routes on their way to the host), emitted once the chunk they were read after is done
    self._route_reads: list[tuple[Trajectory, Any]] = []
    self._state = engine.init_decode_state()
    if warm_up:  # compile the batched prefills' shapes in the background, e.g. while weights arrive
      engine.warm_up(self._state)
    self._thread: Optional[threading.Thread] = None
    self._stop = threading.Event()
    self.error: Optional[BaseException] = None
    self.stats = DecodeStats()  # the decode loop's thread counts; readers take .copy()
    record = engine.sampling.record()
    self._meta = dict(logprob_source=record["logprob_source"], sampling=record,
                      tokenizer_id=engine.tokenizer.identity, server_id=server_id)
    self._stop_ids = np.asarray(sorted(engine.tokenizer.stop_ids), np.int32)
    self.episodes = Episodes(engine.tokenizer, self._notify, environments, env_workers, env_timeout,
                             sampling=record)

  def _notify(self) -> None:
    with self._wake:
      self._wake.notify()

  # ------------------------------------------------------------------ public, thread-safe

  def submit(self, *requests: RolloutRequest) -> None:
    with self._wake:
      self._requests.extend(requests)
      self._wake.notify()

  def update_weights(self, params, version: int, *, restart: bool = False) -> None:
    """Publishes new weights; in-flight sequences switch to them at the next step boundary.

    ``restart``: the weights of a new learner (restarted from a checkpoint), of any version, older
    ones included: the work queued and in flight is its predecessor's, and is dropped unfinished (the
    queue now, the sequences in flight when the weights are applied)."""
    with self._wake:
      if restart:
        if self._requests:
          log.info("dropping %d queued requests of the previous learner", len(self._requests))
        self._requests.clear()
        self._aborts.clear()
      elif version <= self.version and (self._pending is None or version <= self._pending[1]):
        raise ValueError(f"weight version {version} is not newer than {self.version}")
      # a restart not yet applied stays one (its sequences in flight are still the previous
      # learner's), but the queue, which now holds the new learner's requests, is kept
      self._pending = (params, version, restart or (self._pending is not None and self._pending[2]))
      self._wake.notify()

  def drain(self, error: str = DRAINED) -> int:
    """Stops taking queued work: every request not yet started comes back now as an aborted
    trajectory (``error`` says why), so that its owner places it elsewhere; sequences in flight go
    on. Returns how many came back."""
    with self._wake:
      requests, self._requests = list(self._requests), collections.deque()
    for r in requests:
      self._emit(InFlight(r).end("aborted", error=error, **self._meta))
    return len(requests)

  def abort(self, request_id: str, error: str = "") -> None:
    with self._wake:
      self._aborts[request_id] = error
      self._wake.notify()

  def abort_active(self, error: str) -> int:
    """Aborts every sequence in flight (``error`` says why); returns how many."""
    with self._wake:
      ids = [b.request.request_id for b in self._slots if b is not None]
      for i in ids:
        self._aborts[i] = error
      self._wake.notify()
    return len(ids)

  def stream_to(self, sink: Callable[[Trajectory], None]) -> None:
    """Sends finished trajectories to ``sink`` from now on (e.g. a gRPC service's outbox)."""
    self._emit = sink

  @property
  def current_params(self):
    """The weights decoding uses now (None before the first update of a server started without)."""
    return self._params

  @property
  def num_active(self) -> int:
    return sum(s is not None for s in self._slots)

  @property
  def num_decoding(self) -> int:
    """Slots decoding now (active ones not parked for an environment)."""
    return sum(s is not None and not s.waiting for s in self._slots)

  @property
  def num_queued(self) -> int:
    with self._lock:
      return len(self._requests)

  def idle(self) -> bool:
    with self._lock:
      return (not self._requests and self._pending is None and self.num_active == 0
              and self._inflight is None and not self._route_reads)

  def start(self) -> "DecodeServer":
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name=f"{self.server_id}-loop", daemon=True)
      self._thread.start()
    return self

  def stop(self, timeout: float = 30.0) -> None:
    self._stop.set()
    with self._wake:
      self._wake.notify()
    if self._thread is not None:
      self._thread.join(timeout)
      self._thread = None
    # the rollouts in flight end with the server (their environments are closed; nobody is sent
    # their trajectories: the controller places work a server lost elsewhere)
    for i, b in enumerate(self._slots):
      if b is not None and not b.done:
        self._slots[i] = None
        b.end("aborted", error="decode server stopped", **self._meta)
    self._emit_routed()  # the finished ones still reading their routes leave with them
    self.episodes.close()

  def run_until_idle(self, max_iterations: int = 1_000_000) -> None:
    """Drives the loop in the calling thread until nothing is queued or in flight (tests, benchmarks);
    an iteration with nothing to decode waits for an environment's answer."""
    for _ in range(max_iterations):
      if self.idle():
        return
      self.iteration(block=True)
    raise RuntimeError(f"not idle after {max_iterations} iterations")

  # ------------------------------------------------------------------ the loop

  def _run(self) -> None:
    try:
      # Every host<->device copy in the loop is explicit (device_put / device_get); an implicit one
      # (a numpy array into a jitted call, a Python scalar read off a device array) would stall the
      # loop on a synchronous transfer, so it is an error here. The guard is per thread: it covers
      # this loop's thread, not the caller's.
      with jax.transfer_guard(self.transfer_guard):
        while not self._stop.is_set():
          self.iteration(block=True)
    except BaseException as e:  # surface the failure: finish everything in flight as "error"
      log.exception("decode server %s failed", self.server_id)
      self.error = e
      self._fail_all(repr(e))

  def iteration(self, block: bool = False) -> None:
    """One pass: weights, aborts, launch the next decode chunk, process the previous one, refill slots.

    The next chunk is dispatched before the previous chunk's tokens are read back, so the host's
    bookkeeping overlaps the device's decoding. Slots freed by the previous chunk are refilled after
    the next one was launched; that chunk's tokens for them are discarded.
    """
    with self._wake:
      # (no weights yet: requests wait; every slot taken, by parked episodes too: they wait)
      nothing_to_serve = (not self._requests or self._params is None
                          or self.num_active == len(self._slots))
      if block and nothing_to_serve and self._pending is None and not self._aborts \
          and self.num_decoding == 0 and self._inflight is None and not self._stop.is_set() \
          and not self.episodes.pending():
        t = time.perf_counter()
        self._wake.wait(timeout=0.5)
        self.stats.idle_seconds += time.perf_counter() - t
      pending, self._pending = self._pending, None
      if pending is not None and self._draining(pending):
        self._pending, pending = pending, None  # (no new sequence starts while an update waits)
      aborts, self._aborts = self._aborts, {}
    if pending is not None or aborts:
      self._collect()  # weight refills and aborts need every token generated so far
    if pending is not None:
      self._apply_weights(*pending)
    if aborts:
      self._apply_aborts(aborts)
    launched = self._launch() if self.num_decoding else None
    self._collect()
    self._inflight = launched
    self._take_outcomes()
    self._fill_slots()
    if self._inflight is None:  # nothing decoding to overlap with: the routes read now
      self._emit_routed()

  def _draining(self, pending) -> bool:
    """Whether ``pending`` weights wait for the sequences in flight (``on_weight_update="drain"``; a
    restart's weights never wait: the sequences in flight are dropped)."""
    if self.on_weight_update != "drain" or pending[2] or not self.num_active:
      return False
    if self._drain_started is None:
      self._drain_started = time.perf_counter()
    return True

  def _apply_weights(self, params, version: int, restart: bool = False) -> None:
    if self._drain_started is not None:  # the slots' time under the old weights while the update waited
      self.stats.drain_seconds += time.perf_counter() - self._drain_started
      self._drain_started = None
    t = time.perf_counter()
    self._params = self.engine.place_params(params)
    old_version, self.version = self.version, version
    active = [i for i, s in enumerate(self._slots) if s is not None]
    if restart and active:  # the previous learner's sequences: nobody waits for them any more
      log.info("dropping %d sequences in flight of the previous learner", len(active))
      for i in active:
        self._slots[i].end("aborted", error="dropped: a restarted learner's weights arrived", **self._meta)
        self._slots[i] = None
      active = []
    if active and self.on_weight_update == "keep_cache":
      for i in active:  # their pending next-token logits came from the weights being replaced
        if self._slots[i].next_token_version is None and not self._slots[i].waiting:
          self._slots[i].next_token_version = old_version
      self.stats.continued_sequences += len(active)
    elif active:  # (parked episodes too: their context is re-prefilled, and they stay parked)
      active = [i for i in active if not self._slots[i].starting]  # (nothing prefilled yet)
      width = max((len(self._slots[i].context) for i in active), default=1)
      tokens = np.zeros((self.engine.num_slots, width), np.int32)
      lengths = np.zeros(self.engine.num_slots, np.int32)
      for i in active:
        b = self._slots[i]
        seq = b.context
        tokens[i, :len(seq)] = seq
        lengths[i] = len(seq)
        b.interruptions += 1
      self._state = self.engine.refill(self._params, self._state, tokens, lengths)
      jax.block_until_ready(self._state.logits)
      self.stats.interrupted_sequences += len(active)
      self.stats.interrupt_seconds += time.perf_counter() - t
    self.stats.weight_updates += 1

  def _apply_aborts(self, aborts: dict[str, str]) -> None:
    for i, b in enumerate(self._slots):
      if b is not None and b.request.request_id in aborts:
        self._finish(i, "aborted", aborts.pop(b.request.request_id))
    if aborts:
      with self._lock:
        kept = [r for r in self._requests if r.request_id not in aborts]
        dropped = [r for r in self._requests if r.request_id in aborts]
        self._requests = collections.deque(kept)
      for r in dropped:
        self._emit(InFlight(r).end("aborted", error=aborts[r.request_id], **self._meta))

  def _validate(self, r: RolloutRequest) -> str:
    e = self.engine
    n = len(r.prompt_tokens)
    if n == 0:
      return "empty prompt"
    if n > e.max_prefill_length:
      return f"prompt has {n} tokens, more than the engine's max_prefill_length={e.max_prefill_length}"
    if r.max_new_tokens < 1:
      return f"max_new_tokens={r.max_new_tokens} must be >= 1"
    if not 0 <= r.min_new_tokens <= r.max_new_tokens:
      return f"min_new_tokens={r.min_new_tokens} must be in [0, max_new_tokens={r.max_new_tokens}]"
    if n + r.max_new_tokens > e.max_target_length:
      return (f"prompt ({n}) + max_new_tokens ({r.max_new_tokens}) exceeds the cache length "
              f"max_target_length={e.max_target_length}")
    bad = [t for t in r.prompt_tokens if not 0 <= int(t) < e.config.vocab_size]
    if bad:
      return f"prompt token ids {bad[:5]} outside [0, {e.config.vocab_size})"
    return ""

  def _fill_slots(self) -> None:
    """Starts queued requests in the free slots: a single-turn request is prefilled now; an episode
    takes its slot and waits there (parked) while its environment starts off the loop
    (``Episodes.begin``), and is prefilled when it has (``_take_outcomes``)."""
    if self._params is None:
      return
    free = [i for i, s in enumerate(self._slots) if s is None]
    starting: list[InFlight] = []
    slots: list[int] = []
    while free:
      with self._lock:
        # While a weight update is pending, requests wait for it: one admitted under the new version
        # (published before it was submitted) must not be prefilled with the old weights.
        if not self._requests or self._pending is not None:
          break
        request = self._requests.popleft()
      error = self._validate(request)
      if error:
        self._emit(InFlight(request).end("error", error=error, **self._meta))
        self.stats.rejected_requests += 1
        continue
      b = InFlight(request)
      slot = free.pop(0)
      self._slots[slot] = b
      if b.is_episode:
        b.starting = True
        self.episodes.begin(b)
      else:
        starting.append(b)
        slots.append(slot)
    self._prefill(starting, slots)

  def _prefill(self, starting: list, slots: list) -> None:
    if not starting:
      return
    self._state = self.engine.prefill_insert(self._params, self._state, [b.prompt for b in starting], slots,
                                             [b.request.max_new_tokens for b in starting],
                                             [b.request.min_new_tokens for b in starting],
                                             [sampling_stream(b.request.request_id) for b in starting])
    self.stats.started += len(starting)

  def _launch(self) -> tuple:
    self._state, tokens, logp, n = self.engine.steps(self._params, self._state, self.steps_per_call)
    for x in (tokens, logp, n):
      x.copy_to_host_async()
    occupants = [None if b is None or b.waiting else (b, b.epoch) for b in self._slots]
    return tokens, logp, n, occupants, self.version

  def _collect(self) -> None:
    """Records the in-flight chunk's tokens for the sequences that were in their slots at launch.

    Finishing mirrors the device's rule (stop token, or ``max_new_tokens`` reached), so a slot the host
    frees is exactly a slot the device stopped counting as busy. A stop token inside a slot's minimum
    length cannot be sampled (the device bans it), so the rule needs no minimum of its own; one seen
    there means the device broke the ban, and the sequence fails rather than train on it.
    """
    if self._inflight is None:
      return
    tokens, logp, n, occupants, version = self._inflight
    self._inflight = None
    reads, self._route_reads = self._route_reads, []
    tokens, logp, n = jax.device_get((tokens, logp, n))
    self._emit_routed(reads)  # read after the chunk just collected: ready now
    k = int(n)
    if k == 0:  # nothing was busy on the device when the chunk ran
      return
    tokens, logp = tokens[:, :k], logp[:, :k]
    self.stats.steps += k
    self.stats.slot_steps += k * self.engine.num_slots
    is_stop = np.isin(tokens, self._stop_ids)
    first_stop = np.where(is_stop.any(axis=1), is_stop.argmax(axis=1), k)
    parked = []
    for i, occupant in enumerate(occupants):
      if occupant is None:
        continue
      b, epoch = occupant
      if b.done or b.waiting or b.epoch != epoch:  # (a chunk launched before it parked or resumed)
        continue
      room = b.request.max_new_tokens - len(b.tokens)
      take = min(int(first_stop[i]) + 1, room, k)
      before = len(b.tokens)
      b.append(tokens[i, :take].tolist(), logp[i, :take].tolist(), version)
      if take and b.next_token_version is not None:
        b.versions[-take] = b.next_token_version
        b.next_token_version = None
      stopped = take == first_stop[i] + 1  # the stop token itself was taken
      cut = self.episodes.action_end(b, before) if b.is_episode and take else None
      end = None
      if cut is not None:  # an action ended at the environment's stop sequence or cap: drop what follows
        end, ended = cut
        b.truncate(end)
        stopped = False
      self.stats.tokens += len(b.tokens) - before
      if stopped and len(b.tokens) <= b.request.min_new_tokens:
        self._finish(i, "error", f"a stop token at completion token {len(b.tokens) - 1}, inside "
                     f"min_new_tokens={b.request.min_new_tokens}")
      elif b.is_episode and (end is not None or stopped):
        self.episodes.step(b, ended if end is not None else "eos")
        parked.append(i)
      elif stopped:
        self._finish(i, "eos")
      elif len(b.tokens) >= b.request.max_new_tokens:
        self._finish(i, "length")
    if parked:
      self._state = self.engine.park(self._state, parked)

  def _take_outcomes(self) -> None:
    """Takes the environments' outcomes: prefills the episodes whose environment started, ends those
    that finished or failed, and appends observations to the slots' contexts (one batched
    ``extend``) so that they decode again."""
    ready = self.episodes.ready()
    if not ready:
      return
    rows, slots, starts, budgets = [], [], [], []
    started, started_slots = [], []
    for b, decision in ready:
      slot = self._slots.index(b)
      if isinstance(decision, Started):
        b.starting = False
        error = self._validate_prompt(b)
        if error:
          self._finish(slot, "env_error", error)
        else:
          started.append(b)
          started_slots.append(slot)
        continue
      if isinstance(decision, Finish):
        self._finish(slot, decision.reason, decision.error)
        continue
      row, start = decision.tokens, len(b.context)
      if not row:  # nothing to append: recompute the last token, for its next-token logits
        row, start = [b.context[-1]], start - 1
      b.resume(decision.tokens)
      rows.append(row)
      slots.append(slot)
      starts.append(start)
      budgets.append(b.request.max_new_tokens - len(b.tokens))
    self._prefill(started, started_slots)
    if rows:
      self._state = self.engine.extend(self._params, self._state, rows, slots, starts, budgets)
    self.stats.env_steps, self.stats.env_errors = self.episodes.steps, self.episodes.errors
    self.stats.env_seconds = self.episodes.seconds

  def _validate_prompt(self, b: InFlight) -> str:
    """Why an episode's prompt, given by its environment, cannot be prefilled, or ""."""
    if b.prompt == list(b.request.prompt_tokens):
      return ""
    e, n = self.engine, len(b.prompt)
    if n > e.max_prefill_length:
      return (f"the environment's prompt has {n} tokens, more than the engine's "
              f"max_prefill_length={e.max_prefill_length}")
    if n + b.request.max_new_tokens > e.max_target_length:
      return (f"the environment's prompt ({n}) + max_new_tokens ({b.request.max_new_tokens}) exceeds "
              f"the cache length max_target_length={e.max_target_length}")
    return ""

  def _finish(self, slot: int, reason: str, error: str = "") -> None:
    b = self._slots[slot]
    self._slots[slot] = None
    self.stats.count_finished(reason)
    t = b.end(reason, error=error, **self._meta)
    if not self.engine.record_routes or reason == "error" or not len(t.completion_tokens):
      self._emit(t)
      return
    # The slot's routes, read from the newest state (a chunk launched after the slot finished writes
    # only past its tokens), copied while the device goes on; the trajectory leaves with them at the
    # next collection, before the slot's rows can be refilled.
    routes = self.engine.slot_routes(self._state, slot)
    routes.copy_to_host_async()
    self._route_reads.append((t, routes))

  def _emit_routed(self, reads: Optional[list] = None) -> None:
    """Emits finished trajectories with their routes (``reads``: those given; None: every one)."""
    if reads is None:
      reads, self._route_reads = self._route_reads, []
    if not reads:
      return
    rows = jax.device_get([routes for _, routes in reads])
    for (t, _), row in zip(reads, rows):
      n = len(t.prompt_tokens) + len(t.completion_tokens)
      self._emit(dataclasses.replace(t, routes=np.asarray(row[:n], np.int16)))

  def _fail_all(self, message: str) -> None:
    self._inflight = None
    reads, self._route_reads = self._route_reads, []
    for t, _ in reads:  # finished before the failure; their routes may be lost with the device
      self._emit(t)
    for i, b in enumerate(self._slots):
      if b is not None:
        self._finish(i, "error", message)
    with self._lock:
      requests, self._requests = list(self._requests), collections.deque()
    for r in requests:
      self._emit(InFlight(r).end("error", error=message, **self._meta))


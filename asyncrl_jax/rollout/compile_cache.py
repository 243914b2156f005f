"""A jitted batched prefill over a few compiled shapes, with compilation in a background thread."""

from __future__ import annotations

import collections
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl_jax.rollout.prefill_plan import plan_tokens, prefill_plan, prefill_shapes

log = logging.getLogger(__name__)


class ShapedPrefill:
  """A jitted batched prefill ``fn(params, state, tokens [R, W], *row_args [R])`` run over a few
  ``(R, W)`` shapes (host arrays put explicitly on ``sharding``): rows are grouped by ``prefill_plan``; with ``background`` the shapes a plan wants
  but lacks are compiled in a background thread (from abstract arguments: no memory, no compute) while
  compiled shapes are used, as long as they compute at most ``MAX_DETOUR`` times the wanted plan's
  tokens; otherwise the call runs the wanted plan, compiling what it lacks (blocking)."""

  MAX_DETOUR = 4

  def __init__(self, fn, name: str, num_slots: int, max_len: int, background: bool, sharding=None,
               max_tokens: int = 0):
    self.fn, self.name, self.num_slots, self.max_len = fn, name, num_slots, max_len
    self.max_tokens = max_tokens  # no call of more tokens than this, but for single rows (0: no cap)
    self.sharding = sharding  # where the host's tokens and row arguments go (replicated on the mesh)
    self.background = background
    self._ready: set = set()
    self._compiling: set = set()
    self._failed: set = set()  # not retried in the background
    self._queue: collections.deque = collections.deque()
    self._working = False
    self._lock = threading.Lock()

  def programs(self, params, state, num_row_args: int, shapes: str = "covering") -> list:
    """``(name[RxW], fn, abstract arguments)`` of its shapes (``prefill_shapes``), for compiling
    without running: ``shapes="all"`` every one; ``"covering"`` the widest of each row count (the
    same rows at a smaller width compute and hold less)."""
    if shapes not in ("all", "covering"):
      raise ValueError(f"shapes={shapes!r}: 'all' or 'covering'")
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32, sharding=self.sharding)
    out, seen = [], set()
    for rows, width in prefill_shapes(self.num_slots, self.max_len, self.max_tokens):
      if shapes == "all" or rows not in seen:
        seen.add(rows)
        out.append((f"{self.name}[{rows}x{width}]", self.fn,
                    (params, state, spec(rows, width)) + (spec(rows),) * num_row_args))
    return out

  @property
  def compiled(self) -> frozenset:
    with self._lock:
      return frozenset(self._ready)

  def pending(self) -> bool:
    with self._lock:
      return bool(self._compiling)

  def __call__(self, params, state, lengths, tokens, row_args, call_overhead: int):
    """Prefills row ``i`` (``tokens[i, :lengths[i]]``, for each ``lengths[i] > 0``) with its
    ``row_args`` entries: ``row_args`` is a list of (int array [N], padding value)."""
    wanted = prefill_plan(lengths, self.num_slots, self.max_len, call_overhead,
                          max_tokens=self.max_tokens)
    plan = wanted
    if self.background and wanted:
      ready = self.compiled
      missing = {(rows, width) for _, rows, width in wanted} - ready
      if missing:
        usable = prefill_plan(lengths, self.num_slots, self.max_len, call_overhead, available=ready,
                              max_tokens=self.max_tokens)
        # Compiled shapes are used only if they cost at most MAX_DETOUR x the wanted plan's tokens (a
        # large shape for a few rows costs memory as well as time); else the wanted plan runs now.
        if usable is not None and plan_tokens(usable) <= self.MAX_DETOUR * plan_tokens(wanted):
          plan = usable
          self._compile_later(params, state, missing, len(row_args))
    for idx, rows, width in plan:
      t = np.zeros((rows, width), np.int32)
      w = min(width, tokens.shape[1])
      t[:len(idx), :w] = tokens[idx, :w]
      args = []
      for values, pad in row_args:
        a = np.full(rows, pad, np.int32)
        a[:len(idx)] = values[idx]
        args.append(jax.device_put(a, self.sharding))  # explicit: the decode loop is guarded
      state = self.fn(params, state, jax.device_put(t, self.sharding), *args)
      with self._lock:
        self._ready.add((rows, width))
    return state

  def warm_up(self, params, state, num_row_args: int) -> None:
    self._compile_later(params, state, prefill_shapes(self.num_slots, self.max_len, self.max_tokens),
                        num_row_args)

  def _compile_later(self, params, state, shapes, num_row_args: int) -> None:
    """Queues ``shapes`` (in order) for compilation by one background worker, from abstract arguments."""
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None))
    args = (jax.tree.map(spec, params), jax.tree.map(spec, state))
    with self._lock:
      todo = [s for s in shapes if s not in self._ready and s not in self._compiling
              and s not in self._failed]
      self._compiling.update(todo)
      self._queue.extend((s, args, num_row_args) for s in todo)
      start = bool(todo) and not self._working
      self._working = self._working or start
    if start:
      # Not a daemon: the interpreter waits for a compilation in progress instead of exiting under it
      # (the rest of the queue is dropped then). It ends when the queue is empty. One compilation at a
      # time: they compete with decoding for the host.
      try:
        threading.Thread(target=self._work, name=f"{self.name}-compile").start()
      except RuntimeError:  # e.g. the interpreter is shutting down: compile on demand instead
        with self._lock:
          self._compiling.difference_update(todo)
          self._queue.clear()
          self._working = False

  def _work(self) -> None:
    while True:
      with self._lock:
        if not threading.main_thread().is_alive():  # the interpreter is exiting: drop the rest
          self._compiling.difference_update(s for s, _, _ in self._queue)
          self._queue.clear()
        if not self._queue:
          self._working = False
          return
        (rows, width), args, num_row_args = self._queue.popleft()
      try:
        row = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=self.sharding)
        self.fn.lower(*args, jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=self.sharding),
                      *[row] * num_row_args).compile()  # a later call finds it in jit's cache
        with self._lock:
          self._ready.add((rows, width))
      except Exception:  # pylint: disable=broad-except  (the shape then compiles when a call runs it)
        log.warning("background compile of the %dx%d %s failed", rows, width, self.name, exc_info=True)
        with self._lock:
          self._failed.add((rows, width))
      finally:
        with self._lock:
          self._compiling.discard((rows, width))

"""Environment steps off the decode loop: a worker pool that runs each step with a timeout and
reports exactly once, so a slot waiting for its environment holds up no other slot, and an
environment that raises or hangs ends its own episode (finish reason ``env_error`` or
``env_timeout``), never the run.

A step that times out cannot be stopped (Python threads cannot be killed): it is reported at once,
its worker stays busy until the step returns, and its late answer is dropped. The pool's size bounds
how many such steps can pile up; ``stuck`` counts them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent import futures
from typing import Callable, Optional

from asyncrl_jax.envs.base import StepResult

ENV_ERROR, ENV_TIMEOUT = "env_error", "env_timeout"


@dataclasses.dataclass(frozen=True)
class Outcome:
  """A step's end: its result, or why there is none (``finish_reason``), and its wall time."""
  result: Optional[StepResult]  # (what ``step`` returned: a StepResult unless submitted otherwise)
  finish_reason: str = ""  # "" (the step answered), ENV_ERROR or ENV_TIMEOUT
  error: str = ""
  seconds: float = 0.0


class EnvironmentPool:
  """``submit(step, on_done)``: ``step()`` on a worker; ``on_done(Outcome)`` exactly once, from a
  worker or timer thread, within ``timeout`` seconds. ``expect``: the type ``step`` must return (a
  ``StepResult``; None: anything, e.g. an environment's start or ``close``)."""

  def __init__(self, workers: int = 8, timeout: float = 60.0):
    if workers < 1 or not timeout > 0:
      raise ValueError(f"an environment pool needs workers >= 1 and timeout > 0 (got {workers}, {timeout})")
    self.timeout = timeout
    self._pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env")
    self._lock = threading.Lock()
    self.stuck = 0  # steps that timed out and have not returned yet
    self._running: set = set()  # submitted work not yet returned (what ``close`` waits for)

  def submit(self, step: Callable[[], StepResult], on_done: Callable[[Outcome], None],
             expect: Optional[type] = StepResult) -> None:
    t0 = time.perf_counter()
    state = {"done": False, "timed_out": False}

    def finish(outcome: Outcome) -> bool:
      with self._lock:
        if state["done"]:
          return False
        state["done"] = True
      on_done(outcome)
      return True

    def run():
      try:
        result = step()
        if expect is not None and not isinstance(result, expect):
          raise TypeError(f"an environment step returned {type(result).__name__}, not a {expect.__name__}")
        outcome = Outcome(result, seconds=time.perf_counter() - t0)
      except Exception as e:  # pylint: disable=broad-except  (the episode ends, not the run)
        outcome = Outcome(None, ENV_ERROR, f"{type(e).__name__}: {e}"[:500], time.perf_counter() - t0)
      finally:
        timer.cancel()
        with self._lock:
          if state["timed_out"]:
            self.stuck -= 1
      finish(outcome)

    def expire():
      with self._lock:
        if state["done"]:
          return
        state["timed_out"] = True
        self.stuck += 1
      finish(Outcome(None, ENV_TIMEOUT, f"no answer within {self.timeout:g}s", time.perf_counter() - t0))

    timer = threading.Timer(self.timeout, expire)
    timer.daemon = True
    timer.start()
    future = self._pool.submit(run)
    with self._lock:
      self._running.add(future)
    future.add_done_callback(self._returned)

  def _returned(self, future: futures.Future) -> None:
    with self._lock:
      self._running.discard(future)

  def close(self, wait: Optional[float] = None) -> int:
    """Takes no more work; what was submitted still runs (environments' ``close`` among it).
    ``wait``: seconds to wait for it to return (the pool's ``timeout`` if None, 0 not at all);
    returns how many calls had not returned by then (stuck in their environment)."""
    with self._lock:
      running = list(self._running)
    self._pool.shutdown(wait=False, cancel_futures=False)
    wait = self.timeout if wait is None else wait
    if not running or wait <= 0:
      return len(running)
    _, not_done = futures.wait(running, timeout=wait)
    return len(not_done)

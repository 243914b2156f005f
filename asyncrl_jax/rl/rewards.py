"""Verifiable rewards, computed off the learner's critical path.

* ``arithmetic``: exact match of the final answer (text after the last '#') for the built-in task.
* ``math``: ``math-verify`` equivalence of the completion's final answer and the reference (LaTeX,
  fractions, boxed answers...), each check in a worker process with a timeout, since symbolic
  comparison can hang on adversarial output; a timeout scores 0 and is counted.
* ``code``: the completion's last fenced python block run on the problem's tests (the "answer": their
  JSON, ``envs.code_tests``) in the sandbox; 1 only when every test passes (``code_reward``).

``RewardWorker`` scores trajectories on a thread pool as they arrive, so the learner never waits on it.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import multiprocessing
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Optional

from asyncrl_jax.data import arithmetic
from asyncrl_jax.envs import code_tests


def arithmetic_reward(completion: str, answer: str) -> float:
  return arithmetic.reward(completion, answer)


def _math_verify(completion: str, answer: str) -> float:
  from math_verify import parse, verify  # pylint: disable=import-outside-toplevel
  gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
  return float(bool(verify(gold, parse(completion))))


def _limit_memory(max_bytes: int) -> None:
  """Pool initializer: the worker may grow its address space by at most ``max_bytes`` beyond what it
  holds once started (its imports), so a parse that explodes raises MemoryError there instead of
  exhausting the host."""
  import resource  # pylint: disable=import-outside-toplevel
  if max_bytes:
    with open("/proc/self/status") as f:
      size = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + max_bytes, size + max_bytes))


class MathReward:
  """``math-verify`` reward with a per-call timeout (seconds) and a memory cap per worker
  (``max_memory`` bytes of address space beyond its start, 0: none), in a small process pool. A call that times out,
  runs out of memory or raises scores 0 and is counted (``timeouts``, ``failures``); a worker that
  died is replaced. So a pathological completion can neither hang nor kill the controller.

  The timeout bounds one verification, not the worker's start: a new pool (at first and after a
  timeout kills a hung worker) first verifies a trivial answer, waiting up to ``startup_timeout``.
  Without that, on a loaded host the spawn and the import of math-verify (sympy) alone outlast the
  timeout, every call times out, restarts the pool and scores 0, and the run trains on zeros.
  """

  def __init__(self, timeout: float = 5.0, workers: int = 1, startup_timeout: float = 300.0,
               max_memory: int = 4 * 2 ** 30, verify: Callable[[str, str], float] = _math_verify):
    self.timeout, self.startup_timeout = timeout, startup_timeout
    self._workers, self._max_memory, self._verify = workers, max_memory, verify
    self._pool = self._new_pool()
    self.timeouts = 0
    self.failures = 0  # calls that raised (MemoryError, a parser error) or whose worker died

  def _new_pool(self) -> cf.ProcessPoolExecutor:
    # "spawn", not fork: forking a process that runs JAX threads can deadlock the child.
    pool = cf.ProcessPoolExecutor(max_workers=self._workers,
                                  mp_context=multiprocessing.get_context("spawn"),
                                  initializer=_limit_memory, initargs=(self._max_memory,))
    try:
      pool.submit(_math_verify, "1", "1").result(timeout=self.startup_timeout)
    except cf.TimeoutError:
      pool.shutdown(wait=False, cancel_futures=True)
      raise RuntimeError(f"math-verify did not start within {self.startup_timeout:.0f} s") from None
    return pool

  def __call__(self, completion: str, answer: str) -> float:
    try:
      future = self._pool.submit(self._verify, completion, answer)
      return float(future.result(timeout=self.timeout))
    except cf.TimeoutError:
      self.timeouts += 1
      future.cancel()
      self._restart()  # the hung worker would block the next calls
      return 0.0
    except BrokenProcessPool:  # the worker died (killed, or out of memory below the cap)
      self.failures += 1
      self._restart()
      return 0.0
    except Exception:  # pylint: disable=broad-except  # MemoryError under the cap, a parser error
      self.failures += 1
      return 0.0

  def _restart(self) -> None:
    old = self._pool
    self._pool = self._new_pool()
    _stop(old)

  def close(self) -> None:
    """Stops the pool and kills its workers (a worker left running would keep its parent's
    stdout open after the parent left)."""
    _stop(self._pool)


def _stop(pool: cf.ProcessPoolExecutor) -> None:
  """Kills ``pool``'s workers (a hung one would never return) and shuts it down without waiting."""
  for p in list((getattr(pool, "_processes", None) or {}).values()):
    p.kill()
  pool.shutdown(wait=False, cancel_futures=True)


def code_reward(completion: str, tests, *, partial: bool = False,
                limits: code_tests.CodeLimits = code_tests.CodeLimits(), python: str = "") -> float:
  """The program in ``completion`` (its last fenced python block) scored on ``tests`` (a dict or its
  JSON, ``envs.code_tests.parse_tests``) in one sandbox start: 1.0 when every test passes, else 0.0
  (scoring stops at the first failing test); with ``partial`` the fraction passed. A completion
  without a program scores 0. Raises ``CodeTestError`` for malformed tests (the data's fault, not the
  model's) and ``SandboxUnavailable`` where the sandbox cannot run (never runs it unsandboxed)."""
  parsed = code_tests.parse_tests(tests)
  program = code_tests.extract_program(completion)
  if program is None:
    return 0.0
  result = code_tests.run_tests(program, parsed, limits, partial=partial, python=python)
  return result.passed / result.total if partial else float(result.all_passed)


class CodeReward:
  """``code_reward`` with a cache of the last ``cache_size`` (program, tests) scored: the samples of a
  group often write the same program, which is then run once (a call for a program another thread
  is running waits for that run; ``in_flight`` gives that run instead, for a caller that would rather
  be called back). ``runs`` counts sandbox starts, ``calls`` the calls."""

  concurrent = True  # safe to call from several threads at once (held-out evaluation does)

  def __init__(self, cache_size: int = 4096, limits: code_tests.CodeLimits = code_tests.CodeLimits()):
    self._cache: "collections.OrderedDict[tuple, float]" = collections.OrderedDict()
    self._size, self._limits = cache_size, limits
    self._lock = threading.Lock()
    self._running: dict = {}  # key -> Future of the run in progress
    self.calls = self.runs = 0

  @staticmethod
  def _key(completion: str, tests) -> tuple:
    return (code_tests.extract_program(completion),
            tests if isinstance(tests, str) else json.dumps(tests, sort_keys=True))

  def in_flight(self, completion: str, tests) -> Optional[cf.Future]:
    """The run in progress of this completion's program on ``tests`` (a Future of its score), for a
    caller that would rather be called back than wait (``RewardWorker``); None when there is none
    (then call this reward: it is cached, or runs now)."""
    key = self._key(completion, tests)
    with self._lock:
      running = self._running.get(key)
      if running is not None:
        self.calls += 1
      return running

  def __call__(self, completion: str, tests) -> float:
    key = self._key(completion, tests)
    program = key[0]
    with self._lock:
      self.calls += 1
      if key in self._cache:
        self._cache.move_to_end(key)
        return self._cache[key]
      running = self._running.get(key)
      if running is None:
        running = self._running[key] = cf.Future()
        mine = True
      else:
        mine = False
    if not mine:
      return running.result()
    try:
      score = code_reward(completion, tests, limits=self._limits)
    except BaseException as e:
      with self._lock:
        del self._running[key]
      running.set_exception(e)
      raise
    with self._lock:
      self.runs += program is not None
      self._cache[key] = score
      del self._running[key]
      while len(self._cache) > self._size:
        self._cache.popitem(last=False)
    running.set_result(score)
    return score


def reward_fn(task: str) -> Callable[[str, str], float]:
  if task in ("arithmetic", "tool_arithmetic"):  # (the tool task's final answer, after the last '#')
    return arithmetic_reward
  if task in ("code_jsonl", "code_functions"):  # the answer is the problem's tests
    return CodeReward()
  return MathReward()


class RewardWorker:
  """Scores ``(item, completion, answer)`` on threads; calls ``done(item, reward)`` when scored.

  ``decode`` (e.g. a tokenizer's) turns the completion into text on the worker thread, so the caller
  (the decode server's loop, via the controller) only enqueues.
  """

  def __init__(self, fn: Callable[[str, str], float], done: Callable, threads: int = 2,
               decode: Optional[Callable] = None):
    self._fn, self._done, self._decode = fn, done, decode
    self._pool = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reward")
    self._lock = threading.Lock()
    self.errors = 0

  def submit(self, item, completion: str, answer: str) -> None:
    self._pool.submit(self._score, item, completion, answer)

  def _score(self, item, completion, answer) -> None:
    try:
      if self._decode is not None:
        completion = self._decode(completion)
      # a repeat of a program another thread is running: called back when that run ends, so this
      # thread goes on to the next rollout instead of waiting (CodeReward)
      running = self._fn.in_flight(completion, answer) if hasattr(self._fn, "in_flight") else None
      if running is not None:
        running.add_done_callback(lambda f: self._finish(item, f))
        return
      r = float(self._fn(completion, answer))
    except Exception:  # a reward bug must not kill the run; score 0 and count it
      with self._lock:
        self.errors += 1
      r = 0.0
    self._done(item, r)

  def _finish(self, item, future: cf.Future) -> None:
    try:
      r = float(future.result())
    except Exception:  # pylint: disable=broad-except  # (the run it waited for failed: as above)
      with self._lock:
        self.errors += 1
      r = 0.0
    self._done(item, r)

  def close(self) -> None:
    self._pool.shutdown(wait=True)

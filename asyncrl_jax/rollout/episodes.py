"""Multi-turn episodes on a decode server: environments built and reset off the decode loop,
actions cut at the environment's stop sequences, steps run off the loop, environments closed off the
loop, and what each outcome means for the episode.

The decode loop (``decode_loop.DecodeServer``) owns the device; ``inflight.InFlight`` owns each
rollout's host-side state; this module runs the environments. An episode takes a free slot when its
request is admitted, and the slot waits (parked, not decoding) while its environment is built and
reset on a pool worker, with the pool's timeout: an environment that fails or hangs there ends the
episode as ``env_error`` / ``env_timeout`` before any decoding. ``reset`` returns the first context's
text (the request's prompt, which the controller rendered from the problem, is what is prefilled), or
token ids: the episode's prompt, which replaces the request's (an agent program's first request,
rendered with its system message and tools). The slot keeps its KV cache for the whole episode: when
an action ends (at one of the environment's stop sequences, or at the end-of-sequence token) the slot
is parked (the tokens decoded past the end of the action are dropped), the environment steps on a
pool worker, and the loop meanwhile decodes the other slots. The outcome of a step is one of

* ``Finish(reason, error)``: the episode ends (``eos``: its final action was scored; ``env_done``:
  the environment ended it after an action that was not final; ``turns``: the turn limit;
  ``length``: the observation does not fit the token budget; ``env_error``/``env_timeout``);
* ``Resume(tokens)``: the observation's tokens are appended to the slot's context (a prefill with the
  existing prefix: ``Engine.extend``) and decoding resumes in the same slot.

Every turn is recorded (``Trajectory.turns``, ``Turn``): where its action and observation lie in the
completion, its reward, the environment's latency, any error and the environment's ``info``. However an
episode ends (finished, the budget, an abort, a restart of the learner, the server stopping, a failed
environment), its environment's ``close`` runs exactly once, on a pool worker.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Callable, Optional, Union

from asyncrl_jax.envs import base as envs_base
import asyncrl_jax.envs  # noqa: F401  (registers the built-in environments)
from asyncrl_jax.envs.pool import EnvironmentPool, Outcome
from asyncrl_jax.rollout.inflight import InFlight
from asyncrl_jax.tokenization import Tokenizer, TokenizerError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Finish:
  reason: str
  error: str = ""


@dataclasses.dataclass(frozen=True)
class Resume:
  tokens: list


@dataclasses.dataclass(frozen=True)
class Started:
  """The environment is built and reset: the episode may be prefilled (``InFlight.prompt``)."""


class Episodes:
  """The episodes of one decode server. ``notify`` is called (from a pool thread) when a step's
  outcome is ready, so that a loop waiting for work wakes up."""

  def __init__(self, tokenizer: Tokenizer, notify: Callable[[], None],
               pool: Optional[EnvironmentPool] = None, workers: int = 8, timeout: float = 60.0,
               sampling: Optional[dict] = None):
    self.tokenizer = tokenizer
    self.sampling = dict(sampling or {})  # the server's sampling settings (an environment may read them)
    self._notify = notify
    self._pool, self._workers, self._timeout = pool, workers, timeout
    self._ready: "collections.deque[tuple]" = collections.deque()
    self._lock = threading.Lock()
    self.steps = 0
    self.errors = 0  # steps that raised or timed out
    self.seconds = 0.0  # summed step wall time
    self.close_errors = 0  # environments whose close raised or timed out

  @property
  def pool(self) -> EnvironmentPool:
    if self._pool is None:
      self._pool = EnvironmentPool(self._workers, self._timeout)
    return self._pool

  def begin(self, b: InFlight) -> None:
    """Builds the episode's environment and resets it on the problem, on a pool worker; the outcome
    (``Started``, or ``Finish("env_error" | "env_timeout")``) comes back through ``ready``."""
    spec = b.request.episode
    context = {"tokenizer": self.tokenizer, "episode_id": b.request.request_id, "sampling": self.sampling,
               "step_timeout": self._timeout}

    def start():
      env = envs_base.make(spec["env"], context=context, **dict(spec.get("options") or {}))
      try:
        first = env.reset(dict(spec.get("problem") or {}))
      except BaseException:
        _close_quietly(env)
        raise
      return env, first

    b.waiting = True
    self._submit(b, start, "start")

  def _submit(self, b: InFlight, work: Callable, kind: str) -> None:
    epoch = b.epoch

    def done(outcome: Outcome) -> None:
      with self._lock:
        late = b.done or epoch != b.epoch
        if not late:
          self._ready.append((b, epoch, kind, outcome))
      if late and kind == "start" and outcome.result is not None:  # ended while starting
        _close_quietly(outcome.result[0])
      self._notify()

    self.pool.submit(work, done, expect=None if kind == "start" else envs_base.StepResult)

  def action_end(self, b: InFlight, first_new: int) -> Optional[tuple]:
    """Where the current action ends if it now contains one of the environment's stop sequences
    (``(tokens to keep, "stop")``: the earliest prefix whose text holds one) or reached the
    environment's cap (``(cap, "max_tokens")``); None otherwise. Only text ending at or after token
    ``first_new`` is searched (earlier text was)."""
    start = b.action_start
    cap = start + b.action_cap if b.action_cap else None
    stops = tuple(s for s in getattr(b.env, "stop", ()) if s)
    if stops and any(s in self._text(b.tokens[start:cap]) for s in stops):
      for j in range(max(first_new, start) + 1, min(len(b.tokens), cap or len(b.tokens)) + 1):
        if any(s in self._text(b.tokens[start:j]) for s in stops):
          return j, "stop"
    if cap is not None and len(b.tokens) >= cap:
      return cap, "max_tokens"
    return None

  def _text(self, tokens) -> str:
    try:
      return self.tokenizer.decode(tokens)
    except TokenizerError:
      return ""

  def step(self, b: InFlight, ended: str) -> None:
    """Parks ``b`` with the action that just ended (``ended``: ``"stop"`` at a stop sequence,
    ``"eos"``) recorded as a turn, and steps the environment on it off the loop; its outcome is
    taken by ``ready``."""
    tokens = b.park(ended)
    action = envs_base.Action(self._text(tokens), tokens, ended)
    env = b.env
    self._submit(b, lambda: env.step(action), "step")

  def close_env(self, env) -> None:
    """An ended episode's ``env.close()`` (if it has one), on a pool worker with the pool's timeout;
    a failure is counted (``close_errors``), never raised."""
    close = getattr(env, "close", None)
    if close is None:
      return

    def done(outcome: Outcome) -> None:
      if outcome.result is None and outcome.finish_reason:
        with self._lock:
          self.close_errors += 1

    self.pool.submit(close, done, expect=None)

  def pending(self) -> bool:
    """Whether an outcome waits to be taken."""
    with self._lock:
      return bool(self._ready)

  def ready(self) -> list:
    """The outcomes that arrived: ``(rollout, decision)`` for episodes still current (an episode
    aborted, failed or restarted meanwhile is dropped), where the decision is ``Started``, ``Resume``
    or ``Finish``."""
    with self._lock:
      items, self._ready = list(self._ready), collections.deque()
    out = []
    for b, epoch, kind, outcome in items:
      if b.done or epoch != b.epoch:
        if kind == "start" and outcome.result is not None:
          _close_quietly(outcome.result[0])
        continue
      if kind == "start":
        out.append((b, self._started(b, outcome)))
        continue
      self.steps += 1
      self.seconds += outcome.seconds
      out.append((b, self._decide(b, outcome)))
    return out

  def _started(self, b: InFlight, outcome: Outcome) -> Union[Started, Finish]:
    env_name = b.request.episode.get("env")
    if outcome.result is None:
      self.errors += 1
      return Finish(outcome.finish_reason, f"environment {env_name!r} did not start: {outcome.error}"[:500])
    env, first = outcome.result
    b.attach(env, self.close_env)
    if isinstance(first, (list, tuple)):  # the episode's prompt, as token ids
      try:
        prompt = [int(t) for t in first]
      except (TypeError, ValueError):
        prompt = []
      if not prompt or any(not 0 <= t < self.tokenizer.vocab_size for t in prompt):
        self.errors += 1
        return Finish("env_error", f"environment {env_name!r} started with a prompt that is empty or "
                      f"has token ids outside [0, {self.tokenizer.vocab_size})")
      b.prompt = prompt
    b.waiting, b.action_cap = False, _cap(env)
    return Started()

  def _decide(self, b: InFlight, outcome: Outcome) -> Union[Finish, Resume]:
    if outcome.result is None:  # the step raised or timed out
      self.errors += 1
      b.record(latency=round(outcome.seconds, 6), error=outcome.error)
      return Finish(outcome.finish_reason, outcome.error)
    result = outcome.result
    error = str(result.info["error"])[:500] if result.info.get("error") else ""
    b.record(latency=round(outcome.seconds, 6), reward=float(result.reward), info=_jsonable(result.info),
             error=error)
    if result.done:
      return Finish("eos" if b.turns[-1].ended == "eos" else "env_done")
    max_turns = int(b.request.episode.get("max_turns") or 0)
    if max_turns and len(b.turns) >= max_turns:
      return Finish("turns")
    try:
      tokens = (self.tokenizer.encode(result.observation) if isinstance(result.observation, str)
                else [int(t) for t in result.observation])
      if any(not 0 <= t < self.tokenizer.vocab_size for t in tokens):
        raise TokenizerError(f"observation token ids outside [0, {self.tokenizer.vocab_size})")
    except (TokenizerError, TypeError, ValueError) as e:
      self.errors += 1
      b.record(error=f"observation not encodable: {e}"[:500])
      return Finish("env_error", b.turns[-1].error)
    if len(b.tokens) + len(tokens) + 1 > b.request.max_new_tokens:
      b.record(info=dict(b.turns[-1].info, dropped_observation_tokens=len(tokens)))
      return Finish("length")
    b.action_cap = _cap(b.env)
    return Resume(tokens)

  def close(self) -> None:
    """No more environment work; waits (up to the step timeout) for the environments' calls still
    running, ``close()`` of the episodes just ended among them, so nothing outlives its server."""
    if self._pool is not None:
      stuck = self._pool.close()
      if stuck:
        log.warning("%d environment call(s) still running %gs after the decode server stopped; "
                        "left to their threads", stuck, self._pool.timeout)


def _cap(env) -> Optional[int]:
  """The environment's cap on its next action's tokens (``max_action_tokens``), if it sets one."""
  cap = getattr(env, "max_action_tokens", None)
  return int(cap) if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None


def _close_quietly(env) -> None:
  close = getattr(env, "close", None)
  if close is not None:
    try:
      close()
    except Exception:  # pylint: disable=broad-except  (an environment's cleanup never stops the loop)
      pass


def _jsonable(info: dict) -> dict:
  """The environment's ``info`` with values JSON can carry (others as their ``repr``)."""
  out = {}
  for k, v in dict(info).items():
    out[str(k)] = v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)[:200]
  return out

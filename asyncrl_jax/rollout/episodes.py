"""Multi-turn episodes on a decode server: environments built per episode, actions cut at the
environment's stop sequences, steps run off the decode loop, and what each step's outcome means for
the episode.

The decode loop (``decode_loop.DecodeServer``) owns the device; this module owns the episodes'
host-side state. An episode's slot keeps its KV cache for the whole episode: when an action ends (at
one of the environment's stop sequences, or at the end-of-sequence token) the slot is parked (it
stops decoding; the tokens decoded past the end of the action are dropped), the environment steps on
a pool worker, and the loop meanwhile decodes the other slots. The outcome is one of

* ``Finish(reason, error)``: the episode ends (``eos``: its final action was scored; ``env_done``:
  the environment ended it after an action that was not final; ``turns``: the turn limit;
  ``length``: the observation does not fit the token budget; ``env_error``/``env_timeout``);
* ``Resume(tokens)``: the observation's tokens are appended to the slot's context (a prefill with the
  existing prefix: ``Engine.extend``) and decoding resumes in the same slot.

Every turn is recorded (``Trajectory.turns``): where its action and observation lie in the completion,
its reward, the environment's latency, any error and the environment's ``info``.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable, Optional, Union

from asyncrl_jax.envs import base as envs_base
import asyncrl_jax.envs  # noqa: F401  (registers the built-in environments)
from asyncrl_jax.envs.pool import EnvironmentPool, Outcome
from asyncrl_jax.rl.trajectory import _Building
from asyncrl_jax.tokenization import Tokenizer, TokenizerError


@dataclasses.dataclass(frozen=True)
class Finish:
  reason: str
  error: str = ""


@dataclasses.dataclass(frozen=True)
class Resume:
  tokens: list


class Episodes:
  """The episodes of one decode server. ``notify`` is called (from a pool thread) when a step's
  outcome is ready, so that a loop waiting for work wakes up."""

  def __init__(self, tokenizer: Tokenizer, notify: Callable[[], None],
               pool: Optional[EnvironmentPool] = None, workers: int = 8, timeout: float = 60.0):
    self.tokenizer = tokenizer
    self._notify = notify
    self._pool, self._workers, self._timeout = pool, workers, timeout
    self._ready: "collections.deque[tuple]" = collections.deque()
    self._lock = threading.Lock()
    self.steps = 0
    self.errors = 0  # steps that raised or timed out
    self.seconds = 0.0  # summed step wall time

  @property
  def pool(self) -> EnvironmentPool:
    if self._pool is None:
      self._pool = EnvironmentPool(self._workers, self._timeout)
    return self._pool

  def start(self, b: _Building) -> str:
    """Builds the episode's environment and resets it on the problem; an error message if that
    fails (the episode then ends as ``env_error`` before decoding)."""
    spec = b.request.episode
    try:
      env = envs_base.make(spec["env"], context={"tokenizer": self.tokenizer,
                                                 "episode_id": b.request.request_id},
                           **dict(spec.get("options") or {}))
      env.reset(dict(spec.get("problem") or {}))
    except Exception as e:  # pylint: disable=broad-except  (the episode ends, not the run)
      return f"environment {spec.get('env')!r} did not start: {type(e).__name__}: {e}"[:500]
    b.env = env
    return ""

  def action_end(self, b: _Building, first_new: int) -> Optional[int]:
    """Where the current action ends if it now contains one of the environment's stop sequences:
    the number of tokens to keep (the earliest prefix whose text holds a stop sequence); None if
    none does. Only text ending at or after token ``first_new`` is searched (earlier text was)."""
    stops = tuple(s for s in getattr(b.env, "stop", ()) if s)
    if not stops:
      return None
    start = b.action_start
    text = self._text(b.tokens[start:])
    if not any(s in text for s in stops):
      return None
    for j in range(max(first_new, start) + 1, len(b.tokens) + 1):
      if any(s in self._text(b.tokens[start:j]) for s in stops):
        return j
    return None

  def _text(self, tokens) -> str:
    try:
      return self.tokenizer.decode(tokens)
    except TokenizerError:
      return ""

  def step(self, b: _Building, ended: str) -> None:
    """Records the turn whose action just ended (``ended``: ``"stop"`` at a stop sequence, ``"eos"``)
    and steps the environment on it off the loop; its outcome is taken by ``ready``."""
    action = b.tokens[b.action_start:]
    b.turns.append({"action": [b.action_start, len(b.tokens)], "observation": [len(b.tokens)] * 2,
                    "ended": ended, "reward": 0.0, "latency": 0.0, "error": "", "info": {}})
    text = self._text(action)
    epoch, env = b.epoch, b.env

    def done(outcome: Outcome) -> None:
      with self._lock:
        self._ready.append((b, epoch, outcome))
      self._notify()

    self.pool.submit(lambda: env.step(text), done)

  def pending(self) -> bool:
    """Whether an outcome waits to be taken."""
    with self._lock:
      return bool(self._ready)

  def ready(self) -> list:
    """The outcomes that arrived: ``(building, decision)`` for episodes still current (an episode
    aborted, failed or restarted meanwhile is dropped)."""
    with self._lock:
      items, self._ready = list(self._ready), collections.deque()
    out = []
    for b, epoch, outcome in items:
      self.steps += 1
      self.seconds += outcome.seconds
      if b.done or epoch != b.epoch:
        continue
      out.append((b, self._decide(b, outcome)))
    return out

  def _decide(self, b: _Building, outcome: Outcome) -> Union[Finish, Resume]:
    turn = b.turns[-1]
    turn["latency"] = round(outcome.seconds, 6)
    if outcome.result is None:  # the step raised or timed out
      self.errors += 1
      turn["error"] = outcome.error
      return Finish(outcome.finish_reason, outcome.error)
    result = outcome.result
    turn["reward"] = float(result.reward)
    turn["info"] = _jsonable(result.info)
    if result.info.get("error"):
      turn["error"] = str(result.info["error"])[:500]
    if result.done:
      return Finish("eos" if turn["ended"] == "eos" else "env_done")
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
      turn["error"] = f"observation not encodable: {e}"[:500]
      return Finish("env_error", turn["error"])
    if len(b.tokens) + len(tokens) + 1 > b.request.max_new_tokens:
      turn["info"]["dropped_observation_tokens"] = len(tokens)
      return Finish("length")
    return Resume(tokens)

  def ended(self, b: _Building, reason: str) -> None:
    """The episode of ``b`` ended (``reason``): an action cut short (by the budget, an abort) is
    recorded as its last turn, and its environment's ``close`` (if it has one) runs now."""
    covered = b.turns[-1]["observation"][1] if b.turns else 0
    if len(b.tokens) > covered:
      b.turns.append({"action": [covered, len(b.tokens)], "observation": [len(b.tokens)] * 2,
                      "ended": reason, "reward": 0.0, "latency": 0.0, "error": "", "info": {}})
    close = getattr(b.env, "close", None)
    b.env = None
    if close is not None:
      try:
        close()
      except Exception:  # pylint: disable=broad-except  (an environment's cleanup never stops the loop)
        pass

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()


def _jsonable(info: dict) -> dict:
  """The environment's ``info`` with values JSON can carry (others as their ``repr``)."""
  out = {}
  for k, v in dict(info).items():
    out[str(k)] = v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)[:200]
  return out

"""A rollout being generated on a decode server: the one owner of its host-side state.

``InFlight`` holds what a slot has produced so far (tokens, behaviour log-probs, versions, and for an
episode the action mask and the turns) and is the only code that changes it. The decode loop and
``episodes.Episodes`` call its methods; neither edits its fields:

* ``append`` / ``truncate``: tokens decoded (and those decoded past the end of an action, dropped);
* ``park(ended)``: an action ended; its turn is recorded and the slot waits for the environment;
* ``record(...)``: the environment's answer to that action (reward, latency, error, info);
* ``resume(tokens)``: the observation is appended as context and decoding goes on;
* ``end(reason)``: the rollout ends, for any reason, exactly once: an action cut short is recorded as
  the last turn, the episode's environment is closed (once, by the closer it was attached with), and
  the ``Trajectory`` is returned.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import numpy as np

from asyncrl_jax.rl.trajectory import RolloutRequest, Trajectory, Turn


class InFlight:
  """A rollout of ``request`` in progress (see the module's docstring)."""

  def __init__(self, request: RolloutRequest):
    self.request = request
    # the context before the completion: the request's prompt, or the one the episode's environment
    # rendered when it started (an agent program's first request)
    self.prompt: list[int] = list(request.prompt_tokens)
    self.tokens: list[int] = []
    self.logprobs: list[float] = []
    self.versions: list[int] = []
    self.interruptions = 0
    # the version whose logits the next token is drawn from, when it differs from the server's (a
    # weight update without re-prefill: the pending logits were computed by the older weights)
    self.next_token_version: Optional[int] = None
    self.done = False
    self.started_at = time.time()
    self.mask: list[int] = []  # per token: 1 action, 0 observation (episodes only)
    self.turns: list[Turn] = []
    self.action_start = 0  # where the current action starts (index into tokens)
    self.env = None  # the episode's environment
    self._closer: Optional[Callable] = None
    self.waiting = False  # parked: the environment is starting or stepping
    self.starting = False  # an episode whose environment is starting: nothing prefilled yet
    self.action_cap: Optional[int] = None  # the current action ends at this many tokens (the environment's)
    self.epoch = 0  # bumped when the slot parks or resumes: a chunk launched before is not its own

  @property
  def is_episode(self) -> bool:
    return self.request.episode is not None

  @property
  def context(self) -> list[int]:
    """Every token the slot's cache holds: the prompt, then the completion so far."""
    return self.prompt + self.tokens

  def attach(self, env, closer: Callable) -> None:
    """The episode's environment, started; ``closer(env)`` runs once when the rollout ends."""
    self.env, self._closer = env, closer

  def append(self, tokens, logprobs, version: int) -> None:
    self.tokens.extend(tokens)
    self.logprobs.extend(logprobs)
    self.versions.extend([version] * len(tokens))
    if self.is_episode:
      self.mask.extend([1] * len(tokens))

  def truncate(self, n: int) -> None:
    """Drops every token from ``n`` on (decoded past the end of an action)."""
    for seq in (self.tokens, self.logprobs, self.versions, self.mask):
      del seq[n:]

  def park(self, ended: str) -> list[int]:
    """The current action ended (``"stop"`` at a stop sequence, ``"eos"``): records its turn, parks
    the slot, and returns the action's tokens."""
    n = len(self.tokens)
    self.turns.append(Turn(action=(self.action_start, n), observation=(n, n), ended=ended))
    self.waiting, self.epoch = True, self.epoch + 1
    return self.tokens[self.action_start:]

  def record(self, **fields) -> None:
    """The environment's answer to the last action: ``reward``, ``latency``, ``error``, ``info``."""
    self.turns[-1] = dataclasses.replace(self.turns[-1], **fields)

  def resume(self, tokens: list[int]) -> None:
    """Appends the observation (context, not actions: log-prob 0, version -1, mask 0) and lets the
    slot decode the next action."""
    n = len(tokens)
    start = len(self.tokens)
    self.tokens.extend(tokens)
    self.logprobs.extend([0.0] * n)
    self.versions.extend([-1] * n)
    self.mask.extend([0] * n)
    self.turns[-1] = dataclasses.replace(self.turns[-1], observation=(start, start + n))
    self.action_start, self.waiting, self.epoch = len(self.tokens), False, self.epoch + 1

  def end(self, reason: str, *, logprob_source: str = "", sampling: Optional[dict] = None,
          tokenizer_id: str = "", server_id: str = "", error: str = "") -> Trajectory:
    """Ends the rollout (``reason``: a finish reason): an episode's action cut short becomes its last
    turn and its environment is closed. Raises if it ended already: every path ends a rollout once."""
    if self.done:
      raise RuntimeError(f"rollout {self.request.request_id} ended twice (now {reason!r})")
    self.done, self.waiting = True, False
    if self.is_episode:
      covered = self.turns[-1].observation[1] if self.turns else 0
      if len(self.tokens) > covered:
        n = len(self.tokens)
        self.turns.append(Turn(action=(covered, n), observation=(n, n), ended=reason))
    self.close_env()
    r = self.request
    return Trajectory(
        trajectory_id=r.request_id, prompt_id=r.prompt_id, group_id=r.group_id,
        prompt_tokens=np.asarray(self.prompt, np.int32),
        completion_tokens=np.asarray(self.tokens, np.int32),
        logprobs=np.asarray(self.logprobs, np.float32), versions=np.asarray(self.versions, np.int32),
        finish_reason=reason, logprob_source=logprob_source,
        sampling=dict(sampling or {}, min_new_tokens=r.min_new_tokens),
        tokenizer_id=tokenizer_id, server_id=server_id, num_interruptions=self.interruptions,
        error=error, started_at=self.started_at, finished_at=time.time(), incarnation=r.incarnation,
        action_mask=np.asarray(self.mask, np.int32) if self.is_episode else None,
        turns=tuple(self.turns) if self.is_episode else None)

  def close_env(self) -> None:
    """Closes the episode's environment if it has one still open (at most once)."""
    env, closer = self.env, self._closer
    self.env = self._closer = None
    if env is not None and closer is not None:
      closer(env)

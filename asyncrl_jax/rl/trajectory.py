"""What a rollout request asks for and what a finished trajectory records."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Optional

import numpy as np

# eos: the policy stopped (a single-turn completion, or an episode's final action); length: the token
# budget ran out; turns: an episode reached its turn limit; env_done: the environment ended the
# episode after an action that was not final; env_error / env_timeout: its step raised or took too
# long (the episode ends, not the run); aborted / error: not a finished rollout
FINISH_REASONS = ("eos", "length", "turns", "env_done", "env_error", "env_timeout", "aborted", "error")
EPISODE_ENDS = ("turns", "env_done", "env_error", "env_timeout")
# the error of a rollout a decode server gave back unfinished because it is shutting down: not the
# rollout's fault, so placing it elsewhere does not count as a retry
DRAINED = "decode server draining"


def new_id() -> str:
  return uuid.uuid4().hex


@dataclasses.dataclass
class RolloutRequest:
  """One generation to run.

  ``request_id`` becomes the trajectory id: it is unique, so a trajectory delivered twice (a retried
  stream, a restarted server) can be recognised and dropped by the consumer. ``incarnation`` names
  the learner process that asked (its start, ``time.time_ns()``; 0: none given): a decode server
  serves one incarnation at a time, and drops the work of older ones when a newer one sends weights.
  ``min_version`` is the oldest policy version it may start under: the version its admission counted
  with. The staleness bound holds only if no token of it is older, so a request is placed (first,
  again after a server is lost, or when resubmitted) only on a server that holds at least that
  version.
  """
  prompt_tokens: list[int]
  max_new_tokens: int
  request_id: str = dataclasses.field(default_factory=new_id)
  prompt_id: str = ""
  group_id: int = -1
  incarnation: int = 0
  min_version: int = 0
  min_new_tokens: int = 0
  # a multi-turn episode (None: one completion): {"env": registered name, "options": {...},
  # "problem": {...}, "max_turns": n}. ``max_new_tokens`` then bounds every token after the prompt
  # (actions and observations: what the slot's cache holds)
  episode: Optional[dict] = None


@dataclasses.dataclass(frozen=True)
class Turn:
  """One turn of an episode: the policy's action, then the environment's observation, as half-open
  ranges of completion-token indices (``observation`` is empty where the episode ended), the turn's
  reward, how long the environment took (seconds), any error, the environment's ``info`` (JSON
  values), and how the action ended: ``stop`` (at one of the environment's stop sequences), ``eos``,
  or the finish reason of an action cut short (``length``, ``aborted``, ...)."""
  action: tuple
  observation: tuple
  ended: str = "stop"
  reward: float = 0.0
  latency: float = 0.0
  error: str = ""
  info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Trajectory:
  """A finished (or aborted / failed) generation with everything the learner needs.

  Per completion token: ``completion_tokens[t]``, ``logprobs[t]`` (behaviour log-prob, from the source
  named by ``logprob_source``) and ``versions[t]`` (the policy version that sampled it). ``sampling``
  records the server's settings and the request's ``min_new_tokens`` (tokens ``t < min_new_tokens``
  were sampled with the stop tokens banned). A trajectory
  interrupted by weight updates holds several versions, non-decreasing along the sequence.
  """
  trajectory_id: str
  prompt_id: str
  group_id: int
  prompt_tokens: np.ndarray
  completion_tokens: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  finish_reason: str
  logprob_source: str
  sampling: dict
  tokenizer_id: str
  server_id: str = ""
  num_interruptions: int = 0
  error: str = ""
  started_at: float = 0.0
  finished_at: float = 0.0
  reward: Optional[float] = None
  reward_source: str = ""
  incarnation: int = 0  # of the learner that requested it (``RolloutRequest.incarnation``)
  # per completion token: 1 for a policy action (sampled, with its behaviour log-prob and version),
  # 0 for context the policy did not sample (an environment's observation: log-prob 0, version -1,
  # no loss). None: every completion token is an action (a single-turn completion)
  action_mask: Optional[np.ndarray] = None
  # an episode's turns, in order (None: a single-turn completion)
  turns: Optional[tuple] = None
  # a mixture-of-experts policy's routes (``rollout.record_routes``), int16 ``[P + C, L_moe, k]``:
  # per token of the sequence (the prompt's, then the completion's), the k experts each MoE layer
  # chose in the last forward pass the server ran over that token (a re-prefill after a weight update
  # overwrites the prefix's); the learner replays them (routing replay). None: not recorded
  routes: Optional[np.ndarray] = None

  def __post_init__(self):
    if self.finish_reason not in FINISH_REASONS:
      raise ValueError(f"finish_reason={self.finish_reason!r}: must be one of {FINISH_REASONS}")
    n = len(self.completion_tokens)
    if len(self.logprobs) != n or len(self.versions) != n:
      raise ValueError(f"trajectory {self.trajectory_id}: {n} tokens but {len(self.logprobs)} "
                       f"log-probs and {len(self.versions)} versions")
    if self.action_mask is not None and len(self.action_mask) != n:
      raise ValueError(f"trajectory {self.trajectory_id}: {n} tokens but an action mask of "
                       f"{len(self.action_mask)}")
    if self.routes is not None:
      routes = np.asarray(self.routes)
      total = len(self.prompt_tokens) + n
      if routes.ndim != 3 or routes.shape[0] != total or routes.dtype != np.int16:
        raise ValueError(f"trajectory {self.trajectory_id}: routes must be int16 [{total} tokens, MoE "
                         f"layers, k], got {routes.dtype}{list(routes.shape)}")

  @property
  def nbytes(self) -> int:
    """The bytes of the trajectory's per-token arrays (tokens, log-probs, versions, action mask and
    routes), what a stream of them moves per token beside the messages' fields."""
    arrays = (self.prompt_tokens, self.completion_tokens, self.logprobs, self.versions,
              self.action_mask, self.routes)
    return int(sum(np.asarray(a).nbytes for a in arrays if a is not None))

  @property
  def episode_reward(self) -> float:
    """The sum of an episode's turn rewards (0.0 for a single-turn completion)."""
    return float(sum(t.reward for t in self.turns or ()))

  @property
  def actions(self) -> np.ndarray:
    """bool ``[n]``: which completion tokens the policy sampled."""
    if self.action_mask is None:
      return np.ones(len(self.completion_tokens), bool)
    return np.asarray(self.action_mask) == 1

  @classmethod
  def failed(cls, request: RolloutRequest, error: str, **meta) -> "Trajectory":
    """A rollout of ``request`` that produced nothing trainable (a prompt skipped before decoding, a
    message that does not parse): no tokens, ``finish_reason="error"``, under the request's id.
    ``meta``: further fields (``tokenizer_id``, ``server_id``, ...)."""
    meta = {"logprob_source": "", "sampling": {}, "tokenizer_id": "", **meta}
    return cls(trajectory_id=request.request_id, prompt_id=request.prompt_id, group_id=request.group_id,
               prompt_tokens=np.asarray(request.prompt_tokens, np.int32),
               completion_tokens=np.zeros(0, np.int32), logprobs=np.zeros(0, np.float32),
               versions=np.zeros(0, np.int32), finish_reason="error", error=error,
               incarnation=request.incarnation, **meta)

  @property
  def num_tokens(self) -> int:
    return len(self.prompt_tokens) + len(self.completion_tokens)

  def version_segments(self) -> list[tuple[int, int, int]]:
    """``(version, start, end)`` runs of completion tokens sampled by the same policy version."""
    out, start = [], 0
    v = self.versions
    for t in range(1, len(v) + 1):
      if t == len(v) or v[t] != v[start]:
        out.append((int(v[start]), start, t))
        start = t
    return out

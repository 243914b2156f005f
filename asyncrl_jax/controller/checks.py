"""What a trajectory must be for the controller to train it: well formed for its request
(``check_trajectory``: its prompt, lengths, tokens in the vocabulary, finite log-probs, versions that
never decrease nor come from the future, over its actions; context tokens carry neither) and sampled with the settings the learner computes its
log-probs for (``sampling_mismatch``: otherwise the run stops with ``SamplingMismatch``)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from asyncrl_jax.rl.trajectory import RolloutRequest, Trajectory, Turn


class SamplingMismatch(RuntimeError):
  """A decode server sampled with other settings than the learner computes its log-probs for: its
  behaviour log-probs are of another distribution, so the run cannot go on (the message names the
  decode server and the field)."""


def sampling_mismatch(t: Trajectory, sampling: dict) -> str:
  """What in ``t``'s recorded sampling settings differs from ``sampling`` (the learner's), or ""."""
  for field, want in sampling.items():
    got = t.logprob_source if field == "logprob_source" else t.sampling.get(field)
    if got != want:
      return (f"decode server {t.server_id or '?'!r} sampled {t.trajectory_id} with "
              f"rollout.{field}={got!r}, but the learner computes log-probs for "
              f"rollout.{field}={want!r}; start the decode servers with the learner's rollout settings")
  return ""


def check_trajectory(t: Trajectory, request: RolloutRequest, *, vocab_size: int, newest_version: int,
                     routes: Optional[tuple[int, int, int]] = None) -> str:
  """Why ``t`` (returned for ``request``) cannot be trained, or "" if it can. Failed and aborted
  trajectories are not checked here (they carry no usable tokens). ``routes``: ``(MoE layers, k,
  experts)`` when the run replays recorded routes (each token needs k distinct experts per layer)."""
  n = len(t.completion_tokens)
  # an episode's environment may render the prompt itself (an agent program's first request, with
  # its system message and tools): the request's prompt is then a placeholder
  if list(t.prompt_tokens) != list(request.prompt_tokens) and (request.episode is None
                                                               or not len(t.prompt_tokens)):
    return "prompt differs from the request's"
  if n == 0:
    return "no completion tokens"
  if n > request.max_new_tokens:
    return f"{n} completion tokens, more than max_new_tokens={request.max_new_tokens}"
  recorded_min = t.sampling.get("min_new_tokens", 0)
  if recorded_min != request.min_new_tokens:
    return (f"sampled with min_new_tokens={recorded_min!r}, but the request asked for "
            f"{request.min_new_tokens}")
  if n < request.min_new_tokens:
    return f"{n} completion tokens, fewer than min_new_tokens={request.min_new_tokens}"
  if len(t.logprobs) != n or len(t.versions) != n:
    return f"{n} tokens but {len(t.logprobs)} log-probs and {len(t.versions)} versions"
  if t.completion_tokens.min() < 0 or t.completion_tokens.max() >= vocab_size:
    return f"a token outside the vocabulary [0, {vocab_size})"
  if t.action_mask is not None:
    mask = np.asarray(t.action_mask)
    if not np.all((mask == 0) | (mask == 1)) or not mask.any():
      return "an action mask that is not 0/1 or has no action"
    context = ~t.actions
    if np.any(t.logprobs[context] != 0) or np.any(t.versions[context] != -1):
      return "context tokens (action mask 0) with a log-prob or a version (they were not sampled)"
  actions = t.actions
  logprobs, versions = t.logprobs[actions], t.versions[actions]
  if not np.all(np.isfinite(logprobs)) or logprobs.max() > 1e-3:
    return "a log-prob that is not finite or is positive"
  if versions.min() < 0 or np.any(np.diff(versions) < 0):
    return "versions that decrease along the sequence (or are negative)"
  if versions.max() > newest_version:
    return f"a token of version {int(versions.max())}, newer than the learner's {newest_version}"
  if routes is not None:
    problem = _check_routes(t, *routes)
    if problem:
      return problem
  return _check_turns(t, request)


def _check_routes(t: Trajectory, layers: int, k: int, experts: int) -> str:
  if t.routes is None:
    return "no routes, but the run replays them (rollout.record_routes=True)"
  r = np.asarray(t.routes)
  if r.shape[1:] != (layers, k):
    return f"routes of shape {list(r.shape)}, not [tokens, {layers} MoE layers, {k} experts]"
  if r.size and (r.min() < 0 or r.max() >= experts):
    return f"a routed expert outside [0, {experts})"
  if r.size and k > 1 and np.any(np.diff(np.sort(r, axis=-1), axis=-1) == 0):
    return "a token routed twice to one expert in a layer"
  return ""


def _check_turns(t: Trajectory, request: RolloutRequest) -> str:
  """An episode's turns tile its completion in order (each action, then its observation), the
  actions exactly the tokens the mask calls actions; a single-turn request has no turns."""
  if (request.episode is None) != (t.turns is None):
    return ("turns for a single-turn request" if request.episode is None
            else "no turns for an episode's request")
  if t.turns is None:
    return ""
  n, at = len(t.completion_tokens), 0
  mask = t.actions
  for k, turn in enumerate(t.turns):
    if not isinstance(turn, Turn):
      return f"turn {k} is a {type(turn).__name__}, not a Turn"
    (a0, a1), (o0, o1) = turn.action, turn.observation
    if not at == a0 <= a1 == o0 <= o1 <= n:
      return f"turn {k}: action {[a0, a1]} and observation {[o0, o1]} do not follow on at token {at}"
    if not mask[a0:a1].all() or mask[o0:o1].any():
      return f"turn {k}: the action mask disagrees with its action and observation ranges"
    at = o1
  if at != n:
    return f"the turns cover {at} of {n} completion tokens"
  return ""

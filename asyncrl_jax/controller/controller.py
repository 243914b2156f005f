"""The controller: admits rollouts under the staleness bound, collects and scores trajectories, forms
training batches oldest-first, computes advantages.

Batches are blocks of the prompt stream in admission order: batch ``k`` holds the groups of prompts
``[k * P, (k + 1) * P)`` (``P = batch_size / group_size``). Because admission follows the AReaL bound
(``rollout_capacity``) and batches are consumed in admission order, every trajectory trained at version
``k`` was admitted at a version ``>= k - eta``, so its oldest token is at most ``eta`` versions old
(checked again for every batch; ``StalenessError`` if ever violated). The rollout side stays busy
generating the next ``eta`` batches while the learner waits for the oldest one's stragglers. It also
makes the set of trained prompts a function of the seed and the number of steps alone, which is what
makes resuming exact: a checkpoint at version ``k`` resumes the prompt stream at batch ``k``'s first
prompt.

Data shaping (DAPO, Yu et al. 2025), each off by default: ``rl.filter_uniform_groups`` drops a group
whose rewards are all equal (no advantage signal) as soon as it is scored, gives its places back to
admission (``StalenessManager.drop_accepted``) and forms each batch from the next ``P`` informative
groups in admission order instead, so a batch still holds ``P`` groups; the staleness bound still
holds (every admitted group counts until it is dropped, and batches consume groups at least as fast
as before) and resuming stays exact (a checkpoint records where its next batch starts).
``rl.overlong_filter`` gives completions cut by the length budget loss weight 0 (they stay in the
normaliser); ``rl.overlong_penalty_len`` (``L``) adds DAPO's soft overlong penalty to the reward of
a completion longer than ``max_new_tokens - L``: ``-(n - (max_new_tokens - L)) / L``.

Duplicate deliveries are dropped by trajectory id. A rollout that comes back aborted, failed
(``finish_reason == "error"``) or malformed (``check_trajectory``: a prompt other than the request's,
tokens outside the vocabulary, versions that decrease or come from the future, log-probs that are not
finite or positive, more tokens than asked for) is resubmitted under the same id up to
``max_retries`` times; then it keeps its place in the group with no tokens and reward 0 (a failed
rollout), so a bad prompt or server cannot stall training. Every rejection is counted by reason
(``rejected``), failures too.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable, Optional

import numpy as np

from asyncrl_jax import envs
from asyncrl_jax.data.pipeline import Prompt, PromptStream
from asyncrl_jax.data.workloads import LengthWorkload
from asyncrl_jax.models.sampling import SamplingSettings
from asyncrl_jax.rl import advantages, batching
from asyncrl_jax.rl.rewards import RewardWorker
from asyncrl_jax.rl.shaping import overlong_penalty, uniform
from asyncrl_jax.rl.staleness import StalenessManager, VersionMismatch, within_bound
from asyncrl_jax.controller.checks import SamplingMismatch, check_trajectory, sampling_mismatch  # noqa: F401
from asyncrl_jax.rl.trajectory import DRAINED, RolloutRequest, Trajectory
from asyncrl_jax.tokenization import Tokenizer

log = logging.getLogger(__name__)


class StalenessError(RuntimeError):
  """A batch would train on data older than rl.max_staleness (a bug, never expected)."""


@dataclasses.dataclass
class _Group:
  prompt: Prompt
  requests: dict  # id -> RolloutRequest
  trajectories: dict = dataclasses.field(default_factory=dict)  # id -> Trajectory
  rewards: dict = dataclasses.field(default_factory=dict)  # id -> float
  admitted_at: int = -1  # the version admission counted with
  filtered: bool = False  # dropped by rl.filter_uniform_groups (all rewards equal)

  @property
  def complete(self) -> bool:
    return len(self.rewards) == len(self.requests)


@dataclasses.dataclass
class TrainingBatch:
  version: int  # the policy version this batch trains (it produces version + 1)
  sequences: list  # SequenceData per trajectory
  trajectories: list
  rewards: np.ndarray
  prompt_indices: list
  prompt_digests: list  # Prompt.digest of each group's question, in the order of prompt_indices
  max_staleness_seen: int  # version minus the oldest token's version, over the batch
  mean_staleness: float  # of that per trajectory
  min_staleness_seen: int  # version minus the newest token's version (= max with pinned staleness)
  failed: int
  filtered_groups: int = 0  # groups skipped to form this batch (rl.filter_uniform_groups)
  overlong_filtered: int = 0  # trajectories given loss weight 0 (rl.overlong_filter)
  overlong_penalty: float = 0.0  # mean soft overlong penalty added to the rewards (rl.overlong_penalty_len)
  # seconds ``next_batch`` waited for this batch while every trajectory it still lacked had been
  # decoded and was being scored: the learner's wait on the reward function
  reward_wait_seconds: float = 0.0
  wait_seconds: float = 0.0  # all the seconds ``next_batch`` waited for this batch


class Controller:
  """Feeds a rollout backend (anything with ``submit(*requests)``) and assembles training batches."""

  def __init__(self, *, prompts: PromptStream, tokenizer: Tokenizer, submit: Callable,
               manager: StalenessManager, version: Callable[[], int],
               reward: Callable[[str, str], float], batch_size: int,
               group_size: int, max_new_tokens: int, advantage: str = "group",
               scale_by_std: bool = False, reward_threads: int = 2,
               reward_source: str = "exact_answer", max_retries: int = 2,
               newest_version: Optional[Callable[[], int]] = None,
               max_prompt_len: Optional[int] = None, sampling: Optional[dict] = None,
               min_new_tokens: int = 0, lengths: Optional[LengthWorkload] = None, seed: int = 0,
               filter_uniform_groups: bool = False, overlong_filter: bool = False,
               overlong_penalty_len: int = 0, episode: Optional[dict] = None,
               routes: Optional[tuple[int, int, int]] = None):
    if advantage not in ("group", "value"):
      raise ValueError(f"advantage={advantage!r} must be 'group' or 'value'")
    if batch_size % group_size:
      raise ValueError(f"batch_size {batch_size} is not a multiple of group_size {group_size}")
    self.prompts = prompts
    self.tokenizer = tokenizer
    self._submit = submit
    self.manager = manager
    # The version admission counts with: that of the weights the decode servers were last sent (it
    # lags the learner's during a push, so nothing admitted "at v" starts under older weights).
    self.version = version
    self.batch_size, self.group_size = batch_size, group_size
    self.prompts_per_batch = batch_size // group_size
    self.max_new_tokens = max_new_tokens
    if not 0 <= min_new_tokens <= max_new_tokens:
      raise ValueError(f"min_new_tokens={min_new_tokens} must be in [0, max_new_tokens={max_new_tokens}]")
    if lengths is not None and lengths.cap > max_new_tokens:
      raise ValueError(f"the length workload's cap {lengths.cap} exceeds max_new_tokens={max_new_tokens}")
    # each request's minimum length; a length workload instead draws each request's exact length
    self.min_new_tokens, self.lengths, self.seed = min_new_tokens, lengths, seed
    self.max_prompt_len = max_prompt_len  # longer prompts are skipped (None: no limit here)
    # what every trajectory's recorded sampling settings must be (None: not checked)
    self.sampling = sampling
    self.error: Optional[BaseException] = None  # a fault that stops the run (raised by next_batch)
    self.skipped_prompts = 0  # over max_prompt_len: never decoded, their group trained as failed
    self.scale_by_std = scale_by_std
    # "group": group-relative advantages computed here; "value": each trajectory's reward on its last
    # token, for the learner's critic (asyncrl_jax.learner.critic), so no trajectory waits for another's
    self.advantage = advantage
    self.reward_source = reward_source
    if filter_uniform_groups and advantage != "group":
      raise ValueError("filter_uniform_groups needs group advantages (a group of rewards to compare)")
    if not 0 <= overlong_penalty_len < max_new_tokens:
      raise ValueError(f"overlong_penalty_len={overlong_penalty_len} must be in [0, max_new_tokens="
                       f"{max_new_tokens})")
    self.filter_uniform_groups, self.overlong_filter = filter_uniform_groups, overlong_filter
    self.overlong_penalty_len = overlong_penalty_len
    # every rollout a multi-turn episode of this spec (``envs.episode_template``; None: one completion
    # each): the environment scores it, per turn, on the decode server
    self.episode = episode
    # (MoE layers, k, experts) when trajectories must carry their routes (rollout.record_routes),
    # which the batches then hold for the learner (routing replay); None: routes are not kept
    self.routes = routes
    self._groups: dict[int, _Group] = {}
    self._seen: set[str] = set()
    # prompt-stream state at each admitted group not yet trained (a batch may start at any of them)
    self._states: dict[int, dict] = {}
    # the first group of the next batch, and that batch's version (batches are consumed in order)
    self._next_group, self._next_version = prompts.next_index, manager.trained_versions
    self.filtered_groups = 0
    self._scoring: set = set()  # trajectories handed to the reward worker, not yet scored
    self._reward_wait_seconds = self._wait_seconds = 0.0  # of the batch being waited for
    self._pumping = threading.local()  # (a skipped prompt's dropped group does not pump from pump)
    self._cond = threading.Condition()
    self.newest_version = newest_version or version  # no token may be newer than this
    self.max_retries = max_retries
    self._retries: collections.Counter = collections.Counter()  # request id -> resubmissions
    self.duplicates = 0
    self.failed = 0
    self.rejected: collections.Counter = collections.Counter()  # reason -> rejected trajectories
    self.retried = 0
    self._rewards = RewardWorker(reward, self._on_reward, threads=reward_threads, decode=tokenizer.decode)

  @classmethod
  def from_config(cls, config, *, prompts: PromptStream, tokenizer: Tokenizer, submit: Callable,
                  version: Callable[[], int], reward: Callable[[str, str], float],
                  num_servers: int, newest_version: Optional[Callable[[], int]] = None
                  ) -> "Controller":
    """The main job's controller: ``rl`` and ``learner`` sections, a staleness manager sized to the
    decode slots of ``num_servers`` servers (whole groups), restored at the current ``version()``."""
    group = config.rl.group_size
    slots = config.rollout.num_slots * num_servers
    manager = StalenessManager(batch_size=config.learner.batch_size,
                               max_staleness=config.rl.max_staleness,
                               max_concurrent=-(-slots // group) * group)
    manager.restore(version())
    return cls(prompts=prompts, tokenizer=tokenizer, submit=submit, manager=manager, version=version,
               reward=reward, batch_size=config.learner.batch_size, group_size=group,
               max_new_tokens=config.data.max_completion_len, advantage=config.rl.advantage,
               scale_by_std=config.rl.scale_by_std, max_retries=config.rollout.max_retries,
               reward_source=("environment" if config.env.name else "exact_answer"
                              if config.data.task == "arithmetic" else "code_tests"
                              if config.data.task in ("code_jsonl", "code_functions") else "math_verify"),
               newest_version=newest_version, max_prompt_len=config.data.max_prompt_len,
               sampling=SamplingSettings.from_config(config).record(),
               min_new_tokens=config.rollout.min_new_tokens,
               lengths=LengthWorkload.parse(config.rollout.length_workload), seed=config.seed,
               filter_uniform_groups=config.rl.filter_uniform_groups,
               reward_threads=config.rl.reward_threads,
               overlong_filter=config.rl.overlong_filter,
               overlong_penalty_len=config.rl.overlong_penalty_len,
               episode=envs.episode_template(config), routes=_route_check(config))

  # ------------------------------------------------------------------ admission

  def _lengths(self, prompt_index: int, sample: int) -> dict:
    """A request's ``max_new_tokens`` and ``min_new_tokens``: the run's, or a drawn exact length."""
    if self.lengths is None:
      return dict(max_new_tokens=self.max_new_tokens, min_new_tokens=self.min_new_tokens)
    n = self.lengths.draw(self.seed, prompt_index, sample)
    return dict(max_new_tokens=n, min_new_tokens=n)

  def _episode(self, prompt: Prompt) -> Optional[dict]:
    if self.episode is None:
      return None
    return dict(self.episode, problem={"question": prompt.question, "answer": prompt.answer})

  def pump(self) -> int:
    """Admits as many whole groups as the staleness bound and slots allow; returns rollouts started."""
    self._pumping.active = True
    try:
      return self._pump()
    finally:
      self._pumping.active = False

  def _pump(self) -> int:
    started = 0
    while True:
      with self._cond:
        version = self.version()
        if self.manager.capacity(version) < self.group_size:
          return started
        index = self.prompts.next_index
        self._states[index] = self.prompts.get_state()
        admitted = self.manager.try_submit(self.group_size, version)
        if admitted < self.group_size:  # lost a race with another pump: give the places back
          self.manager.reject(admitted)
          return started
        prompt = self.prompts.next()
        tokens = self.tokenizer.encode_prompt(prompt.question)
        requests = {f"p{prompt.index}-s{j}": RolloutRequest(
            prompt_tokens=tokens, request_id=f"p{prompt.index}-s{j}", prompt_id=str(prompt.index),
            group_id=prompt.index, min_version=version, episode=self._episode(prompt),
            **self._lengths(prompt.index, j)) for j in range(self.group_size)}
        self._groups[prompt.index] = _Group(prompt, requests, admitted_at=version)
        too_long = self.max_prompt_len is not None and len(tokens) > self.max_prompt_len
      if too_long:  # its place in the batch is kept: failed rollouts, reward 0, no gradient
        self._skip(prompt.index, f"prompt {prompt.index} has {len(tokens)} tokens, more than "
                   f"data.max_prompt_len={self.max_prompt_len}: skipped")
        continue
      self._submit(*requests.values())
      started += self.group_size

  def _skip(self, index: int, reason: str) -> None:
    """The group of prompt ``index`` is not decoded: each of its rollouts counts as failed."""
    with self._cond:
      group = self._groups[index]
      self.skipped_prompts += 1
      for i, r in group.requests.items():
        t = Trajectory.failed(r, reason, tokenizer_id=self.tokenizer.identity)
        self._seen.add(i)
        group.trajectories[i] = t
        self.failed += 1
    log.warning("%s", reason)
    for t in list(group.trajectories.values()):
      self.manager.accept()
      self._on_reward(t, 0.0)

  def data_state_for(self, batch_index: int) -> dict:
    """Prompt-stream state at the first prompt of ``batch_index``, the next batch (for checkpoints)."""
    with self._cond:
      if batch_index == self._next_version:
        if self._next_group in self._states:
          return self._states[self._next_group]
        if self.prompts.next_index == self._next_group:
          return self.prompts.get_state()
    raise KeyError(f"no prompt-stream state recorded for batch {batch_index}")

  # ------------------------------------------------------------------ arrivals

  def on_trajectory(self, t: Trajectory) -> None:
    """Called by the rollout backend (any thread) for every finished trajectory."""
    with self._cond:
      if t.trajectory_id in self._seen:
        self.duplicates += 1
        return
      group = self._groups.get(t.group_id)
      if group is None or t.trajectory_id not in group.requests:
        log.warning("dropping trajectory %s of unknown group %s", t.trajectory_id, t.group_id)
        self.duplicates += 1
        return
      request = group.requests[t.trajectory_id]
      mismatch = (self.sampling is not None and t.finish_reason in ("eos", "length")
                  and sampling_mismatch(t, self.sampling))
      if mismatch:
        self.error = SamplingMismatch(mismatch)
        self._cond.notify_all()
        return
      kind, detail = self._rejection(t, request)
      reason = f"{kind}: {detail}" if detail else kind
      resubmit = None
      if kind == "drained":  # given back by a server shutting down: placed again, not a retry
        self.rejected[kind] += 1
        resubmit = request
      elif kind:
        self.rejected[kind] += 1
        if self._retries[t.trajectory_id] < self.max_retries:
          self._retries[t.trajectory_id] += 1
          self.retried += 1
          resubmit = request
        else:  # out of retries: trained as a failed rollout
          t = dataclasses.replace(t, finish_reason="error", error=f"{reason} (after "
                                  f"{self.max_retries} retries)")
      if resubmit is None:
        self._seen.add(t.trajectory_id)
        group.trajectories[t.trajectory_id] = t
    if resubmit is not None:
      if kind == "drained":
        log.info("rollout %s given back by %s (draining); placed again", t.trajectory_id, t.server_id)
      else:
        log.warning("rollout %s rejected (%s); resubmitted (%d of %d)", t.trajectory_id, reason,
                    self._retries[t.trajectory_id], self.max_retries)
      self._submit(resubmit)
      return
    self.manager.accept()
    self.pump()  # a place was freed: admit more
    if t.finish_reason == "error":
      with self._cond:
        self.failed += 1
      log.warning("rollout %s failed: %s", t.trajectory_id, t.error)
      self._on_reward(t, 0.0)
      return
    if t.turns is not None:  # an episode: its environment scored it
      self._on_reward(t, t.episode_reward)
      return
    with self._cond:
      self._scoring.add(t.trajectory_id)
      self._cond.notify_all()  # (a waiting next_batch re-asks what it waits for)
    self._rewards.submit(t, t.completion_tokens, self._groups[t.group_id].prompt.answer)

  def _rejection(self, t: Trajectory, request: RolloutRequest) -> tuple[str, str]:
    """Why ``t`` is not accepted as it is, as (kind, detail); kind "" if it is accepted. Kinds:
    "drained" (a server shutting down gave it back), "aborted", "failed", "malformed"."""
    if t.finish_reason == "aborted":
      return ("drained", "") if t.error == DRAINED else ("aborted", t.error)
    if t.finish_reason == "error":
      return ("malformed" if t.error.startswith("malformed") else "failed"), t.error
    problem = check_trajectory(t, request, vocab_size=self.tokenizer.vocab_size,
                               newest_version=self.newest_version(), routes=self.routes)
    return ("malformed", problem) if problem else ("", "")

  def _on_reward(self, t: Trajectory, reward: float) -> None:
    dropped = 0
    with self._cond:
      self._scoring.discard(t.trajectory_id)
      t.reward = reward
      t.reward_source = self.reward_source if t.finish_reason != "error" else "failed_rollout"
      group = self._groups[t.group_id]
      group.rewards[t.trajectory_id] = reward
      if self.filter_uniform_groups and group.complete and uniform(group.rewards.values()):
        group.filtered = True  # no signal: its places go back to admission, the batch takes the next
        self.filtered_groups += 1
        dropped = len(group.requests)
        self.manager.drop_accepted(dropped)
      self._cond.notify_all()
    if dropped and not getattr(self._pumping, "active", False):  # (pump's own loop goes on anyway)
      self.pump()

  # ------------------------------------------------------------------ batches

  def _scan(self) -> tuple[list, int, bool]:
    """From the next batch's first group, in admission order: (the informative groups' indices, up
    to ``P``; the index after the last group looked at; whether they are all complete)."""
    taken, index = [], self._next_group
    while len(taken) < self.prompts_per_batch:
      group = self._groups.get(index)
      if group is None or not group.complete:
        return taken, index, False
      if not group.filtered:
        taken.append(index)
      index += 1
    return taken, index, True

  def next_batch(self, version: int, timeout: Optional[float] = None) -> Optional[TrainingBatch]:
    """Blocks until the batch that trains ``version`` is complete; ``None`` on timeout. Raises
    ``VersionMismatch`` unless ``version`` is the next batch's: batches are consumed one per version,
    in order. A batch is the next ``P`` groups in admission order (the next ``P`` informative ones
    with ``rl.filter_uniform_groups``)."""
    deadline = None if timeout is None else time.time() + timeout
    with self._cond:
      self._check_batch_index(version)
      while True:
        taken, end, ready = self._scan()
        if ready:
          break
        if self.error is not None:
          raise self.error
        remaining = None if deadline is None else deadline - time.time()
        if remaining is not None and remaining <= 0:
          return None
        scoring_only = self._waits_on_rewards()
        t0 = time.perf_counter()
        self._cond.wait(timeout=remaining if remaining is not None else 1.0)
        waited = time.perf_counter() - t0
        self._wait_seconds += waited
        self._reward_wait_seconds += waited if scoring_only else 0.0
      skipped = [self._groups.pop(i) for i in range(self._next_group, end) if i not in taken]
      if len(skipped) >= 4 * self.prompts_per_batch:
        log.warning("the batch for version %d skipped %d groups whose rewards were all equal (every "
                    "sample right, or every one wrong): the task is far too easy or too hard for the "
                    "policy (rl.filter_uniform_groups)", version, len(skipped))
      groups = [self._groups.pop(i) for i in taken]
      for i in range(self._next_group, end):
        self._states.pop(i, None)
      self._next_group, self._next_version = end, version + 1
      waits = dict(reward_wait_seconds=self._reward_wait_seconds, wait_seconds=self._wait_seconds)
      self._reward_wait_seconds = self._wait_seconds = 0.0
    return dataclasses.replace(self._assemble(groups, version, filtered=len(skipped)), **waits)

  def _waits_on_rewards(self) -> bool:
    """(Under the lock.) Whether every trajectory the next batch's groups still lack has been decoded
    and is being scored (none is still decoding, and every group is admitted). With
    ``rl.filter_uniform_groups`` the batch's groups are not known ahead: the next ``P`` are looked at."""
    groups = [self._groups.get(i) for i in range(self._next_group, self._next_group + self.prompts_per_batch)]
    if any(g is None for g in groups):
      return False
    missing = [r for g in groups for r in g.requests if r not in g.rewards]
    return bool(missing) and all(r in self._scoring for r in missing)

  def settled(self, version: int) -> bool:
    """Whether every rollout the bound admits at ``version`` was admitted, has finished and has been
    scored (pinned staleness publishes ``version + 1`` then: a group still being scored may yet be
    dropped by the group filter, which would give its places back to admission under ``version``)."""
    with self._cond:
      return self.manager.exhausted(version) and all(g.complete for g in self._groups.values())

  def wait(self, timeout: float) -> None:
    """Blocks until a trajectory is scored (or ``timeout`` seconds pass); raises a run-stopping
    fault (``error``) as ``next_batch`` does."""
    with self._cond:
      if self.error is not None:
        raise self.error
      self._cond.wait(timeout=timeout)

  def missing(self, version: int) -> list[str]:
    """The request ids the batch of ``version`` still waits for (admitted, not yet scored), as far as
    its groups are known (with group filtering, later groups may still join it)."""
    with self._cond:
      if version != self._next_version:
        return []
      if self.filter_uniform_groups:  # (up to the first group not yet complete)
        end = self._scan()[1] + 1
      else:
        end = self._next_group + self.prompts_per_batch
      groups = [self._groups[i] for i in range(self._next_group, end) if i in self._groups]
      return [i for g in groups for i in sorted(g.requests) if i not in g.rewards]

  def _check_batch_index(self, version: int) -> None:
    """The next batch this controller forms must be the one for ``version``."""
    if version < self._next_version:
      raise VersionMismatch(f"the batch of version {version} was already handed out (the controller has "
                            f"admitted prompts up to {self.prompts.next_index - 1}); the learner's "
                            "version fell behind its batches")
    if version > self._next_version:
      raise VersionMismatch(f"the controller's oldest untrained batch is {self._next_version}, but the "
                            f"learner asks for the batch of version {version}")

  def _assemble(self, groups, version: int, filtered: int = 0) -> TrainingBatch:
    ids = [(g, i) for g in groups for i in sorted(g.requests)]
    trajectories = [g.trajectories[i] for g, i in ids]
    rewards = np.array([g.rewards[i] for g, i in ids], np.float32)
    # counted on the policy's own tokens: an episode's observations are not its length
    penalty = np.array([overlong_penalty(int(t.actions.sum()), g.requests[i].max_new_tokens,
                                         self.overlong_penalty_len) for (g, i), t in zip(ids, trajectories)],
                       np.float32)
    shaped = rewards + penalty  # (the batch reports the task's rewards; advantages see the penalty)
    group_ids = np.repeat(np.arange(len(groups)), self.group_size)
    if self.advantage == "group":
      adv, _ = advantages.group_advantages(shaped, group_ids, num_groups=len(groups),
                                           scale_by_std=self.scale_by_std)
    else:
      adv = np.zeros_like(rewards)
    sequences, staleness, newest_seen, failed, overlong = [], [], [], 0, 0
    for (g, rid), t, a, r in zip(ids, trajectories, np.asarray(adv), shaped):
      if t.finish_reason == "error" or not len(t.completion_tokens):
        failed += 1
        continue
      acted = t.versions[t.actions]  # (context tokens were not sampled: no version)
      oldest, newest = int(acted.min()), int(acted.max())
      if newest > version:
        raise VersionMismatch(f"decode server {t.server_id!r} sampled a token of {t.trajectory_id} at "
                              f"policy version {newest}, but the learner is at version {version}")
      if not within_bound(version=version, oldest_token_version=oldest,
                          max_staleness=self.manager.max_staleness):
        raise StalenessError(f"batch for version {version} holds data {version - oldest} versions old > "
                             f"rl.max_staleness={self.manager.max_staleness} (a token of "
                             f"{t.trajectory_id} was sampled at version {oldest}; its group was "
                             f"admitted at version {g.admitted_at}; decoded by {t.server_id!r}, "
                             f"token versions {oldest}..{newest}, {t.num_interruptions} "
                             "interruptions)")
      staleness.append(version - oldest)
      newest_seen.append(version - newest)
      token_reward = None  # value mode: the reward on the last token (an episode's on its turns)
      if self.advantage == "value":
        token_reward = (batching.episode_token_rewards(t.turns, len(t.completion_tokens),
                                                       float(r) - t.episode_reward)
                        if t.turns else float(r))
      cut = self.overlong_filter and t.finish_reason == "length"
      overlong += cut
      sequences.append(batching.make_sequence(t.prompt_tokens, t.completion_tokens, logprobs=t.logprobs,
                                              versions=t.versions, advantage=float(a),
                                              token_reward=token_reward,
                                              min_new_tokens=g.requests[rid].min_new_tokens,
                                              weight=0.0 if cut else 1.0, action_mask=t.action_mask,
                                              routes=t.routes if self.routes else None))
    max_seen = max(staleness, default=0)
    return TrainingBatch(version=version, sequences=sequences, trajectories=trajectories,
                         rewards=rewards,
                         prompt_indices=[g.prompt.index for g in groups],
                         prompt_digests=[g.prompt.digest for g in groups], max_staleness_seen=max_seen,
                         mean_staleness=float(np.mean(staleness)) if staleness else 0.0,
                         min_staleness_seen=min(newest_seen, default=0), failed=failed,
                         filtered_groups=filtered, overlong_filtered=overlong,
                         overlong_penalty=float(penalty.mean()) if len(penalty) else 0.0)

  def close(self) -> None:
    self._rewards.close()


def _route_check(config) -> Optional[tuple[int, int, int]]:
  """(MoE layers, k, experts) of the policy when the run records routes, else None."""
  if not config.rollout.get("record_routes"):
    return None
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  m = models.config_of(config)
  return (*m.route_shape, m.num_experts)

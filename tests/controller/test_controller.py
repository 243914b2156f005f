"""Controller: admission under the bound, dedupe, oldest-first batches, advantages, failures."""


import dataclasses

import numpy as np
import pytest

from asyncrl_jax.controller.controller import Controller, StalenessError
from asyncrl_jax.data.pipeline import PromptStream
from asyncrl_jax.rl.staleness import StalenessManager, VersionMismatch
from asyncrl_jax.rl.trajectory import Trajectory
from asyncrl_jax.tokenization import ArithmeticTokenizer

TOK = ArithmeticTokenizer()


def _source(n=64):
  return [{"question": f"{i % 10}+{i // 10 % 10}=".encode(), "answer": str(i % 10 + i // 10 % 10).encode(),
           "solution": b""} for i in range(n)]


class _Learner:
  """Stands in for the learner's version count (the only one there is)."""
  version = 0


def _make(eta=1, batch=4, group=2, slots=100):
  submitted, learner = [], _Learner()
  mgr = StalenessManager(batch_size=batch, max_staleness=eta, max_concurrent=slots)
  ctl = Controller(prompts=PromptStream(_source(), seed=0, shard_index=0, shard_count=1), tokenizer=TOK,
                   submit=lambda *r: submitted.extend(r), manager=mgr, version=lambda: learner.version,
                   reward=lambda text, answer: float(text.endswith("#" + answer)),
                   batch_size=batch, group_size=group, max_new_tokens=8)
  return ctl, learner, submitted


def _finish(req, version, reason="eos"):
  return Trajectory(trajectory_id=req.request_id, prompt_id=req.prompt_id, group_id=req.group_id,
                    prompt_tokens=np.asarray(req.prompt_tokens, np.int32),
                    completion_tokens=np.asarray([4, 13, 4, 14, 5, 2], np.int32),
                    logprobs=np.full(6, -0.5, np.float32), versions=np.full(6, version, np.int32),
                    finish_reason=reason, logprob_source="sampling", sampling={}, tokenizer_id="t")


def test_admission_follows_the_staleness_bound():
  ctl, learner, submitted = _make(eta=1, batch=4, group=2)
  ctl.pump()
  assert len(submitted) == (1 + 0 + 1) * 4  # (eta + version + 1) * B
  assert [r.request_id for r in submitted[:3]] == ["p0-s0", "p0-s1", "p1-s0"]
  assert len({r.group_id for r in submitted}) == 4
  ctl.close()


def _answered(ctl, r, right: bool, version: int = 0):
  """A finished trajectory for request ``r`` whose completion is the right answer or a wrong one."""
  t = _finish(r, version)
  answer = ctl._groups[r.group_id].prompt.answer  # pylint: disable=protected-access
  t.completion_tokens = np.asarray(TOK.encode("#" + (answer if right else answer + "1")), np.int32)
  t.logprobs = np.zeros(len(t.completion_tokens), np.float32)
  t.versions = np.full(len(t.completion_tokens), version, np.int32)
  return t


def test_batches_in_admission_order_with_group_advantages_and_dedupe():
  ctl, learner, submitted = _make(eta=1, batch=4, group=2)
  ctl.pump()
  # Sample 0 of prompt 0 and both samples of prompt 2 answer right; every other sample is wrong.
  right = {"p0-s0", "p2-s0", "p2-s1"}
  # Deliver batch 1's trajectories first, then batch 0's, and one duplicate (a wrong copy: dropped).
  for r in submitted[4:8] + submitted[0:4]:
    ctl.on_trajectory(_answered(ctl, r, r.request_id in right))
  ctl.on_trajectory(_answered(ctl, submitted[0], False))
  b0 = ctl.next_batch(version=0, timeout=10)
  assert b0.prompt_indices == [0, 1] and ctl.duplicates == 1
  assert len(b0.sequences) == 4 and b0.max_staleness_seen == 0
  b1 = ctl.next_batch(version=1, timeout=10)
  assert b1.prompt_indices == [2, 3] and b1.max_staleness_seen == 1
  # Group-relative advantages (reward minus the group mean), by hand: prompt 0 holds one right and one
  # wrong sample (+0.5, -0.5); prompts 1, 2 and 3 are all-equal groups (0). Prompt tokens carry 0.
  want = {"p0-s0": 0.5, "p0-s1": -0.5, "p1-s0": 0.0, "p1-s1": 0.0, "p2-s0": 0.0, "p2-s1": 0.0,
          "p3-s0": 0.0, "p3-s1": 0.0}
  for b in (b0, b1):
    for t, s in zip(b.trajectories, b.sequences):
      np.testing.assert_allclose(s.advantages[s.mask > 0], want[t.trajectory_id])
      assert np.all(s.advantages[s.mask == 0] == 0)
  assert b0.rewards.tolist() == [1.0, 0.0, 0.0, 0.0] and b1.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
  ctl.close()


def test_group_advantage_values():
  ctl, learner, submitted = _make(eta=0, batch=4, group=2)
  ctl.pump()
  for i, r in enumerate(submitted):
    ctl.on_trajectory(_answered(ctl, r, i % 2 == 0))
  b = ctl.next_batch(version=0, timeout=10)
  adv = sorted(float(s.advantages[s.mask > 0][0]) for s in b.sequences)
  # every group of two holds one right (reward 1) and one wrong (0) answer: advantages +-0.5
  assert adv == [-0.5, -0.5, 0.5, 0.5]
  assert sorted(b.rewards.tolist()) == [0.0, 0.0, 1.0, 1.0]
  ctl.close()


def test_value_mode_puts_each_reward_on_its_last_token_with_groups_of_one():
  submitted, learner = [], _Learner()
  ctl = Controller(prompts=PromptStream(_source(), seed=0, shard_index=0, shard_count=1), tokenizer=TOK,
                   submit=lambda *r: submitted.extend(r),
                   manager=StalenessManager(batch_size=4, max_staleness=0, max_concurrent=100),
                   version=lambda: learner.version,
                   reward=lambda text, answer: float(text.endswith("#" + answer)), batch_size=4,
                   group_size=1, max_new_tokens=8, advantage="value")
  ctl.pump()
  assert len(submitted) == 4 and len({r.group_id for r in submitted}) == 4  # four prompts, one each
  right = {r.request_id: i % 2 == 0 for i, r in enumerate(submitted)}
  for r in reversed(submitted):  # arrival order does not change the batch's order
    ctl.on_trajectory(_answered(ctl, r, right[r.request_id]))
  b = ctl.next_batch(version=0, timeout=10)
  assert [t.trajectory_id for t in b.trajectories] == [r.request_id for r in submitted]
  for s, t in zip(b.sequences, b.trajectories):
    reward = 1.0 if right[t.trajectory_id] else 0.0
    expect = np.zeros(len(s.tokens), np.float32)
    expect[-1] = reward  # the reward on the last completion token, nothing else
    np.testing.assert_array_equal(s.advantages, expect)
  ctl.close()


def _train(ctl, learner, batch_requests, versions=None):
  """Delivers a batch's trajectories (tokens at ``versions``, default the learner's), takes the batch
  for the learner's version and counts one trained version, as the main loop does."""
  for r in batch_requests:
    t = _finish(r, learner.version)
    if versions is not None:  # e.g. an interrupted generation: tokens of two versions
      t.versions = np.asarray(versions, np.int32)
    ctl.on_trajectory(t)
  b = ctl.next_batch(version=learner.version, timeout=10)
  learner.version += 1
  ctl.pump()
  return b


def test_too_stale_batch_is_an_error():
  ctl, learner, submitted = _make(eta=0, batch=4, group=2)
  ctl.pump()
  _train(ctl, learner, submitted[:4])
  assert len(submitted) == 8  # batch 1 admitted at version 1
  # each request names the version admission counted with: no server older than it may take it
  assert [r.min_version for r in submitted] == [0] * 4 + [1] * 4
  with pytest.raises(StalenessError, match="1 versions old > rl.max_staleness=0"):
    _train(ctl, learner, submitted[4:8], versions=[0] * 6)  # sampled at version 0, trained at 1
  ctl.close()


def test_staleness_counts_the_oldest_token_of_an_interrupted_trajectory():
  ctl, learner, submitted = _make(eta=1, batch=4, group=2)
  ctl.pump()
  _train(ctl, learner, submitted[:4])
  # Tokens of versions 0 and 1 trained at version 1 with eta 1: within the bound, and the per-token
  # versions reach the learner intact.
  b = _train(ctl, learner, submitted[4:8], versions=[0, 0, 1, 1, 1, 1])
  assert b.max_staleness_seen == 1
  for s in b.sequences:
    assert s.versions[s.mask > 0].tolist() == [0, 0, 1, 1, 1, 1]
    assert np.all(s.versions[s.mask == 0] == -1)
  # The same at version 2: the last tokens are fresh enough, the first two are not.
  with pytest.raises(StalenessError, match="2 versions old > rl.max_staleness=1"):
    _train(ctl, learner, submitted[8:12], versions=[0, 0, 1, 1, 1, 1])
  ctl.close()


def test_versions_disagreeing_with_the_learner_raise_and_name_both():
  ctl, learner, submitted = _make(eta=1, batch=4, group=2)
  ctl.pump()
  with pytest.raises(VersionMismatch, match="oldest untrained batch is 0, but the learner asks for "
                                            "the batch of version 1"):
    ctl.next_batch(version=1, timeout=1)
  _train(ctl, learner, submitted[:4])
  with pytest.raises(VersionMismatch, match="batch of version 0 was already handed out"):
    ctl.next_batch(version=0, timeout=1)
  # a decode server cannot have sampled with a version the learner has not trained yet: rejected on
  # arrival (counted, resubmitted under its id), and the batch forms from the resubmission
  n = len(submitted)
  for r in submitted[4:8]:
    t = _finish(r, 1)
    t.server_id = "decode-7"
    t.versions[-1] = 2 if r.request_id == "p2-s0" else 1
    ctl.on_trajectory(t)
  assert ctl.rejected == {"malformed": 1} and [r.request_id for r in submitted[n:]] == ["p2-s0"]
  ctl.on_trajectory(_finish(submitted[-1], 1))
  assert ctl.next_batch(version=1, timeout=10).failed == 0
  ctl.close()


def _failed(r):
  err = _finish(r, 0, reason="error")
  err.completion_tokens, err.logprobs, err.versions = (np.zeros(0, np.int32), np.zeros(0, np.float32),
                                                       np.zeros(0, np.int32))
  return err


def test_aborted_and_failed_are_resubmitted_then_a_failure_keeps_its_place():
  ctl, learner, submitted = _make(eta=0, batch=4, group=2)
  ctl.pump()
  n = len(submitted)
  ctl.on_trajectory(_finish(submitted[0], 0, reason="aborted"))
  assert len(submitted) == n + 1 and submitted[-1].request_id == submitted[0].request_id
  for attempt in range(3):  # max_retries=2: resubmitted twice, then trained as failed
    ctl.on_trajectory(_failed(submitted[1]))
    assert len(submitted) == n + 1 + min(attempt + 1, 2)
  assert ctl.rejected == {"aborted": 1, "failed": 3} and ctl.retried == 3
  for r in submitted[:n]:
    if r.request_id != submitted[1].request_id:
      ctl.on_trajectory(_finish(r, 0))
  ctl.on_trajectory(_failed(submitted[1]))  # a late duplicate of the failed one: dropped
  b = ctl.next_batch(version=0, timeout=10)
  assert b.failed == 1 and len(b.sequences) == 3 and len(b.trajectories) == 4
  assert ctl.failed == 1 and ctl.duplicates == 1
  assert b.rewards.tolist().count(0.0) >= 1 and "after 2 retries" in b.trajectories[1].error
  ctl.close()


def _bad(kind: str):
  """Changes that make a finished trajectory malformed, each with (part of) the reason it gets."""
  def change(t):
    if kind == "prompt":
      t.prompt_tokens = t.prompt_tokens[:-1]
    elif kind == "vocab":
      t.completion_tokens[2] = TOK.vocab_size
    elif kind == "negative":
      t.completion_tokens[0] = -1
    elif kind == "decreasing":
      t.versions[3] = -1
    elif kind == "logprob":
      t.logprobs[1] = np.nan
    elif kind == "positive":
      t.logprobs[1] = 0.5
    elif kind == "long":
      t.completion_tokens = np.arange(9, dtype=np.int32) % 10 + 4
      t.logprobs, t.versions = np.full(9, -1.0, np.float32), np.zeros(9, np.int32)
    elif kind == "empty":
      t.completion_tokens, t.logprobs, t.versions = (np.zeros(0, np.int32), np.zeros(0, np.float32),
                                                     np.zeros(0, np.int32))
    return t
  return change


@pytest.mark.parametrize("kind, reason", [
    ("prompt", "prompt differs"), ("vocab", "outside the vocabulary"), ("negative", "outside the vocab"),
    ("decreasing", "versions that decrease"), ("logprob", "not finite"), ("positive", "positive"),
    ("long", "more than max_new_tokens=8"), ("empty", "no completion tokens")])
def test_malformed_trajectories_are_rejected_with_their_reason_and_retried(kind, reason, caplog):
  ctl, _, submitted = _make(eta=0, batch=4, group=2)
  ctl.pump()
  n = len(submitted)
  ctl.on_trajectory(_bad(kind)(_finish(submitted[0], 0)))
  assert ctl.rejected == {"malformed": 1} and len(submitted) == n + 1
  assert reason in caplog.text
  for r in submitted[:n]:
    ctl.on_trajectory(_finish(r, 0))  # the resubmission comes back well formed
  b = ctl.next_batch(version=0, timeout=10)
  assert b.failed == 0 and len(b.sequences) == 4
  ctl.close()


def test_a_malformed_message_becomes_a_counted_failure_not_a_broken_stream():
  from asyncrl_jax.rollout import protocol  # pylint: disable=import-outside-toplevel
  m = protocol.MESSAGES["Trajectory"](trajectory_id="p0-s0", group_id=0, prompt_tokens=[1, 2],
                                      completion_tokens=[4, 5, 6], logprobs=[-1.0], versions=[0, 0, 0],
                                      finish_reason="eos")
  t = protocol.trajectory_from_pb(m)
  assert t.finish_reason == "error" and t.trajectory_id == "p0-s0"
  assert t.error.startswith("malformed trajectory message") and "3 tokens but 1 log-probs" in t.error
  for field, value in [("finish_reason", "done"), ("sampling_json", "[1]"), ("sampling_json", "{")]:
    bad = protocol.MESSAGES["Trajectory"](**{"trajectory_id": "x", "finish_reason": "eos", field: value})
    assert protocol.trajectory_from_pb(bad).error.startswith("malformed"), (field, value)
  ctl, _, submitted = _make(eta=0, batch=4, group=2)
  ctl.pump()
  bad = protocol.MESSAGES["Trajectory"](trajectory_id=submitted[0].request_id, group_id=0,
                                        completion_tokens=[4], finish_reason="eos")
  ctl.on_trajectory(protocol.trajectory_from_pb(bad))
  assert ctl.rejected == {"malformed": 1}
  ctl.close()


def test_next_batch_times_out_without_data():
  ctl, _, _ = _make()
  assert ctl.next_batch(version=0, timeout=0.2) is None
  ctl.close()


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_admission_order_bounds_staleness_with_random_stragglers(eta):
  """The controller and staleness manager the main loop runs, fed by a fake decode server that finishes
  requests after heavy-tailed delays (so later requests often overtake earlier ones): batches come in
  admission order and none holds data older than eta, and with eta > 0 the run is really asynchronous."""
  batch, group, slots = 4, 2, 12
  ctl, learner, submitted = _make(eta=eta, batch=batch, group=group, slots=slots)
  rng = np.random.default_rng(eta)
  running, delivered, taken = [], set(), 0  # running: (finish time, request, version at submission)
  version, clock, seen = 0, 0.0, []
  ctl.pump()
  while version < 25:
    for r in submitted[taken:]:
      running.append((clock + float(rng.lognormal(0.0, 1.5)), r, version))
    taken = len(submitted)
    assert len(running) <= slots  # the manager never over-admits
    wanted = {f"p{i}-s{j}" for i in range(version * 2, version * 2 + 2) for j in range(group)}
    if wanted <= delivered:
      b = ctl.next_batch(version=version, timeout=10)
      assert b is not None and b.prompt_indices == [version * 2, version * 2 + 1]
      seen.append(b.max_staleness_seen)
      version += 1
      learner.version = version
      ctl.pump()
      continue
    running.sort(key=lambda x: x[0])
    clock, r, v = running.pop(0)
    delivered.add(r.request_id)
    ctl.on_trajectory(_finish(r, v))
  ctl.close()
  assert max(seen) <= eta
  if eta:
    assert max(seen) >= 1


def test_an_over_long_prompt_is_skipped_and_counted_and_drained_rollouts_are_placed_again_freely():
  from asyncrl_jax.rl.trajectory import DRAINED  # pylint: disable=import-outside-toplevel
  rows = _source(8)
  rows[3]["question"] = b"1+2+3+4+5+6+7+8+9+1+2+3="  # the only prompt over the limit
  short = len(TOK.encode_prompt(rows[0]["question"].decode()))
  submitted, learner = [], _Learner()
  mgr = StalenessManager(batch_size=4, max_staleness=0, max_concurrent=100)
  ctl = Controller(prompts=PromptStream(rows, seed=0, shard_index=0, shard_count=1), tokenizer=TOK,
                   submit=lambda *r: submitted.extend(r), manager=mgr, version=lambda: learner.version,
                   reward=lambda text, answer: 1.0, batch_size=4, group_size=2, max_new_tokens=8,
                   max_prompt_len=short + 2)
  long_prompt, seen = None, set()
  for version in range(4):  # the whole stream: 8 prompts, 2 per version
    learner.version = version
    ctl.pump()
    for r in [r for r in submitted if r.request_id not in seen]:
      seen.add(r.request_id)
      if r.request_id == "p0-s0" and version == 0:  # a server shutting down gives one back
        ctl.on_trajectory(dataclasses.replace(_failed(r), finish_reason="aborted", error=DRAINED))
      ctl.on_trajectory(_finish(r, version))
    b = ctl.next_batch(version=version, timeout=10)
    assert b is not None, version
    for t in b.trajectories:
      if t.finish_reason == "error":
        assert "more than data.max_prompt_len" in t.error and "skipped" in t.error
        long_prompt = t.prompt_id
  assert long_prompt is not None and ctl.skipped_prompts == 1 and ctl.failed == 2
  assert not any(r.prompt_id == long_prompt for r in submitted)  # never sent to a server
  assert ctl.rejected == {"drained": 1} and ctl.retried == 0  # placed again, not a retry
  assert [r.request_id for r in submitted].count("p0-s0") == 2
  ctl.close()


# ----------------------------------------------------------------------------- data shaping (DAPO)


def _shaping(eta=1, batch=4, group=2, **kw):
  submitted, learner = [], _Learner()
  mgr = StalenessManager(batch_size=batch, max_staleness=eta, max_concurrent=100)
  prompts = PromptStream(_source(), seed=0, shard_index=0, shard_count=1)
  ctl = Controller(prompts=prompts, tokenizer=TOK, submit=lambda *r: submitted.extend(r), manager=mgr,
                   version=lambda: learner.version,
                   reward=lambda text, answer: float(text.endswith("#" + answer)),
                   batch_size=batch, group_size=group, max_new_tokens=8, **kw)
  return ctl, learner, submitted, mgr


def _answer_all(ctl, requests, right):
  for r in requests:
    ctl.on_trajectory(_answered(ctl, r, r.request_id in right))


def _eventually(condition, timeout=10.0):
  """(Rewards are scored on worker threads, and a dropped group's places are re-admitted there.)"""
  import time  # pylint: disable=import-outside-toplevel
  deadline = time.time() + timeout
  while not condition():
    assert time.time() < deadline, "condition not reached"
    time.sleep(0.01)


def test_uniform_groups_are_dropped_and_the_batch_filled_from_the_next_groups():
  """Groups 0 (both wrong) and 2 (both right) carry no signal: batch 0 is groups 1 and 3, their places
  went back to admission (which admitted groups 4 and 5 at once), and the checkpoint's next batch
  starts after group 3. Without the filter the same deliveries make batch 0 of groups 0 and 1."""
  right = {"p1-s0", "p2-s0", "p2-s1", "p3-s1", "p4-s0", "p5-s1"}
  ctl, _, submitted, mgr = _shaping(filter_uniform_groups=True)
  ctl.pump()
  assert [r.group_id for r in submitted][::2] == [0, 1, 2, 3]  # (eta + 1) * B = 8 rollouts
  _answer_all(ctl, submitted[:8], right)
  b0 = ctl.next_batch(version=0, timeout=10)
  assert b0.prompt_indices == [1, 3] and b0.filtered_groups == 2 and ctl.filtered_groups == 2
  _eventually(lambda: len(submitted) == 12)
  assert sorted({r.group_id for r in submitted}) == [0, 1, 2, 3, 4, 5]  # two groups' places came back
  assert all(abs(float(s.advantages[s.mask > 0][0])) == 0.5 for s in b0.sequences)
  assert mgr.state.accepted == 4 and mgr.state.running == 4  # groups 1, 3 accepted; 4, 5 running
  state = ctl.data_state_for(1)
  resumed = PromptStream(_source(), seed=0, shard_index=0, shard_count=1)
  resumed.set_state(state)
  assert resumed.next_index == 4  # a resume starts at the first group after batch 0's last
  _answer_all(ctl, submitted[8:12], right)
  assert ctl.next_batch(version=1, timeout=10).prompt_indices == [4, 5]
  ctl.close()
  plain, _, submitted, _ = _shaping()  # the control: no filter, the same answers
  plain.pump()
  _answer_all(plain, submitted[:8], right)
  b = plain.next_batch(version=0, timeout=10)
  assert b.prompt_indices == [0, 1] and b.filtered_groups == 0
  plain.close()


def test_the_staleness_bound_holds_with_group_filtering():
  """However many groups are dropped, no batch trains a token older than eta: versions advance, the
  decode side answers each admitted request at the version it was admitted at, and every other
  group is uniform."""
  ctl, learner, submitted, _ = _shaping(eta=1, filter_uniform_groups=True)
  done = 0
  for version in range(6):
    learner.version = version
    ctl.pump()
    while True:
      new = submitted[done:]
      done = len(submitted)
      for r in new:  # even groups uniform (both wrong), odd ones informative
        t = _answered(ctl, r, r.group_id % 2 == 1 and r.request_id.endswith("s0"), version=r.min_version)
        ctl.on_trajectory(t)
      b = ctl.next_batch(version=version, timeout=0.5)
      if b is not None:
        break
    assert all(g % 2 == 1 for g in b.prompt_indices)
    assert b.max_staleness_seen <= 1
  ctl.close()


def test_overlong_filter_and_soft_penalty():
  """A completion cut by the length budget gets loss weight 0 (its tokens stay in the batch); DAPO's
  soft penalty over the last 4 of 8 tokens, by hand: 6 tokens -> -(6 - 4) / 4 = -0.5 on the reward."""
  from asyncrl_jax.rl.shaping import overlong_penalty  # pylint: disable=import-outside-toplevel
  assert [overlong_penalty(n, 8, 4) for n in (3, 4, 5, 6, 8)] == [0.0, 0.0, -0.25, -0.5, -1.0]
  assert overlong_penalty(8, 8, 0) == 0.0
  ctl, _, submitted, _ = _shaping(eta=0, overlong_filter=True, overlong_penalty_len=4)
  ctl.pump()
  for i, r in enumerate(submitted):
    t = _answered(ctl, r, True)  # "#answer": 2-3 tokens, no penalty
    if i == 0:  # cut at the budget: 8 tokens
      t = _finish(r, 0, reason="length")
      t.completion_tokens = np.asarray([4, 13, 4, 14, 5, 13, 4, 14], np.int32)
      t.logprobs, t.versions = np.full(8, -0.5, np.float32), np.zeros(8, np.int32)
    ctl.on_trajectory(t)
  b = ctl.next_batch(version=0, timeout=10)
  assert b.overlong_filtered == 1
  cut = b.sequences[0]
  assert cut.loss_weight is not None and np.all(cut.loss_weight == 0) and cut.mask.sum() == 8
  assert all(s.loss_weight is None for s in b.sequences[1:])
  # rewards: 0 (wrong and cut), 1, 1, 1; the cut one's penalty (-1 at 8 tokens) enters its group's
  # advantages: group 0 holds rewards (0 - 1) and 1 -> mean 0, advantages -1 and +1
  assert b.rewards.tolist() == [0.0, 1.0, 1.0, 1.0]
  assert b.overlong_penalty == pytest.approx(-0.25)
  np.testing.assert_allclose([float(s.advantages[s.mask > 0][0]) for s in b.sequences], [-1.0, 1.0, 0, 0])
  ctl.close()


def test_the_overlong_penalty_counts_the_policys_tokens_not_an_episodes_observations():
  """8 completion tokens of which 3 are a tool's answer (action mask 0): the policy wrote 5, so the
  penalty over the last 4 of 8 is -(5 - 4) / 4 = -0.25, not the -1 of 8 tokens."""
  ctl, _, submitted, _ = _shaping(eta=0, overlong_penalty_len=4)
  ctl.pump()
  for i, r in enumerate(submitted):
    t = _answered(ctl, r, True)
    if i == 0:
      t = _finish(r, 0, reason="length")
      t.completion_tokens = np.asarray([4, 13, 4, 14, 5, 13, 4, 14], np.int32)
      t.action_mask = np.asarray([1, 1, 0, 0, 0, 1, 1, 1], np.int32)
      t.logprobs = np.where(t.action_mask == 1, -0.5, 0.0).astype(np.float32)  # observations: none
      t.versions = np.where(t.action_mask == 1, 0, -1).astype(np.int32)
    ctl.on_trajectory(t)
  b = ctl.next_batch(version=0, timeout=10)
  assert b.overlong_penalty == pytest.approx(-0.25 / 4)  # the batch's mean over its 4 completions
  assert b.sequences[0].mask.sum() == 5
  ctl.close()


def test_settled_waits_for_every_admitted_group_to_be_scored():
  """Pinned staleness publishes the next version only when the bound's rollouts under this one have
  finished *and been scored*: a group still being scored may be dropped by the group filter and give
  its places back to admission under the old weights."""
  import threading  # pylint: disable=import-outside-toplevel
  gate = threading.Event()
  submitted, learner = [], _Learner()
  mgr = StalenessManager(batch_size=4, max_staleness=0, max_concurrent=100)
  ctl = Controller(prompts=PromptStream(_source(), seed=0, shard_index=0, shard_count=1), tokenizer=TOK,
                   submit=lambda *r: submitted.extend(r), manager=mgr, version=lambda: learner.version,
                   reward=lambda text, answer: float(gate.wait(10)) * 0.0, batch_size=4, group_size=2,
                   max_new_tokens=8, filter_uniform_groups=True)
  ctl.pump()
  assert not ctl.settled(0)
  for r in submitted:
    ctl.on_trajectory(_finish(r, 0))
  assert mgr.exhausted(0) and not ctl.settled(0)  # finished, not yet scored
  gate.set()
  # scored: both groups uniform (reward 0), dropped, and their places re-admitted under version 0
  _eventually(lambda: len(submitted) == 8)
  assert not ctl.settled(0)
  ctl.close()


def test_the_batch_records_how_long_it_waited_on_the_reward_function():
  """``reward_wait_seconds``: the wait while every trajectory the batch lacked was decoded and being
  scored; a slow reward makes it most of the wait, while waiting on decoding counts none of it."""
  import threading  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel

  def slow(text, answer):
    time.sleep(0.4)
    return float(text.endswith("#" + answer))

  for reward, decode_delay in ((slow, 0.0), (lambda text, answer: 1.0, 0.4)):
    submitted, learner = [], _Learner()
    mgr = StalenessManager(batch_size=2, max_staleness=0, max_concurrent=100)
    ctl = Controller(prompts=PromptStream(_source(), seed=0, shard_index=0, shard_count=1), tokenizer=TOK,
                     submit=lambda *r: submitted.extend(r), manager=mgr, version=lambda: learner.version,
                     reward=reward, batch_size=2, group_size=2, max_new_tokens=8, reward_threads=2)
    ctl.pump()
    requests = list(submitted[:2])

    def decode():
      time.sleep(decode_delay)
      for r in requests:
        ctl.on_trajectory(_answered(ctl, r, True))

    threading.Thread(target=decode).start()
    batch = ctl.next_batch(0, timeout=30)
    ctl.close()
    assert batch is not None and batch.wait_seconds >= 0.3
    if decode_delay:  # waiting on decoding: none of it is the reward's
      assert batch.reward_wait_seconds < 0.1, batch
    else:
      assert batch.reward_wait_seconds >= 0.3 and batch.reward_wait_seconds <= batch.wait_seconds + 1e-6, batch

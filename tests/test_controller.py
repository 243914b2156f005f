"""Controller: admission under the bound, dedupe, oldest-first batches, advantages, failures."""


import numpy as np
import pytest

from asyncrl_jax.controller import Controller, StalenessError
from asyncrl_jax.data.pipeline import PromptStream
from asyncrl_jax.rl.staleness import StalenessManager
from asyncrl_jax.rollout.trajectory import Trajectory
from asyncrl_jax.tokenization import ArithmeticTokenizer

TOK = ArithmeticTokenizer()


def _source(n=64):
  return [{"question": f"{i % 10}+{i // 10 % 10}=".encode(), "answer": str(i % 10 + i // 10 % 10).encode(),
           "solution": b""} for i in range(n)]


def _make(eta=1, batch=4, group=2, slots=100):
  submitted = []
  mgr = StalenessManager(batch_size=batch, max_staleness=eta, max_concurrent=slots)
  ctl = Controller(prompts=PromptStream(_source(), seed=0, shard_index=0, shard_count=1), tokenizer=TOK,
                   submit=lambda *r: submitted.extend(r), manager=mgr,
                   reward=lambda text, answer: float(text.endswith("#" + answer)),
                   batch_size=batch, group_size=group, max_new_tokens=8)
  return ctl, mgr, submitted


def _finish(req, version, reason="eos"):
  return Trajectory(trajectory_id=req.request_id, prompt_id=req.prompt_id, group_id=req.group_id,
                    prompt_tokens=np.asarray(req.prompt_tokens, np.int32),
                    completion_tokens=np.asarray([4, 13, 4, 14, 5, 2], np.int32),
                    logprobs=np.full(6, -0.5, np.float32), versions=np.full(6, version, np.int32),
                    finish_reason=reason, logprob_source="sampling", sampling={}, tokenizer_id="t")


def test_admission_follows_the_staleness_bound():
  ctl, mgr, submitted = _make(eta=1, batch=4, group=2)
  ctl.pump()
  assert len(submitted) == (1 + 0 + 1) * 4  # (eta + version + 1) * B
  assert [r.request_id for r in submitted[:3]] == ["p0-s0", "p0-s1", "p1-s0"]
  assert len({r.group_id for r in submitted}) == 4
  ctl.close()


def test_batches_in_admission_order_with_group_advantages_and_dedupe():
  ctl, mgr, submitted = _make(eta=1, batch=4, group=2)
  ctl.pump()
  rewards_seen = []
  ctl._rewards._fn = lambda text, answer: rewards_seen.append(1) or (1.0 if "p0-s0" in text else 0.0)
  # Deliver batch 1's trajectories first, then batch 0's, and one duplicate.
  order = submitted[4:8] + submitted[0:4]
  for r in order:
    ctl.on_trajectory(_finish(r, 0))
  ctl.on_trajectory(_finish(submitted[0], 0))
  b0 = ctl.next_batch(version=0, timeout=10)
  assert b0.prompt_indices == [0, 1] and ctl.duplicates == 1
  assert len(b0.sequences) == 4 and b0.max_staleness_seen == 0
  b1 = ctl.next_batch(version=1, timeout=10)
  assert b1.prompt_indices == [2, 3] and b1.max_staleness_seen == 1
  # Group-relative advantages: reward minus the group mean, on completion tokens only.
  for s in b0.sequences:
    assert np.all(s.advantages[s.mask == 0] == 0)
  ctl.close()


def test_group_advantage_values():
  ctl, mgr, submitted = _make(eta=0, batch=4, group=2)
  ctl.pump()
  answers = {r.request_id: i % 2 == 0 for i, r in enumerate(submitted)}
  ctl._rewards._fn = lambda text, answer: 1.0 if text.endswith("#" + answer) else 0.0
  for r in submitted:
    t = _finish(r, 0)
    right = answers[r.request_id]
    answer = ctl._groups[r.group_id].prompt.answer  # pylint: disable=protected-access
    t.completion_tokens = np.asarray(TOK.encode("#" + (answer if right else answer + "1")), np.int32)
    t.logprobs = np.zeros(len(t.completion_tokens), np.float32)
    t.versions = np.zeros(len(t.completion_tokens), np.int32)
    ctl.on_trajectory(t)
  b = ctl.next_batch(version=0, timeout=10)
  adv = sorted(float(s.advantages[s.mask > 0][0]) for s in b.sequences)
  # every group of two holds one right (reward 1) and one wrong (0) answer: advantages +-0.5
  assert adv == [-0.5, -0.5, 0.5, 0.5]
  assert sorted(b.rewards.tolist()) == [0.0, 0.0, 1.0, 1.0]
  ctl.close()


def test_too_stale_batch_is_an_error():
  ctl, mgr, submitted = _make(eta=0, batch=4, group=2)
  ctl.pump()
  for r in submitted:
    ctl.on_trajectory(_finish(r, 0))
  with pytest.raises(StalenessError, match="2 versions old > rl.max_staleness=0"):
    ctl.next_batch(version=2, timeout=10)
  ctl.close()


def _deliver_mixed(ctl, submitted, versions):
  for r in submitted:
    t = _finish(r, 0)
    t.versions = np.asarray(versions, np.int32)  # an interrupted generation: tokens of two versions
    ctl.on_trajectory(t)


def test_staleness_counts_the_oldest_token_of_an_interrupted_trajectory():
  # Tokens from versions 0 and 1 trained at version 2 with eta 1: the last token is fresh enough,
  # the first two are not, so the batch must be refused.
  ctl, _, submitted = _make(eta=1, batch=4, group=2)
  ctl.pump()
  _deliver_mixed(ctl, submitted[:4], [0, 0, 1, 1, 1, 1])
  with pytest.raises(StalenessError, match="2 versions old > rl.max_staleness=1"):
    ctl.next_batch(version=2, timeout=10)
  ctl.close()
  # The same data at version 1 is within the bound; the per-token versions reach the learner intact.
  ctl, _, submitted = _make(eta=1, batch=4, group=2)
  ctl.pump()
  _deliver_mixed(ctl, submitted[:4], [0, 0, 1, 1, 1, 1])
  b = ctl.next_batch(version=1, timeout=10)
  assert b.max_staleness_seen == 1
  for s in b.sequences:
    assert s.versions[s.mask > 0].tolist() == [0, 0, 1, 1, 1, 1]
    assert np.all(s.versions[s.mask == 0] == -1)
  ctl.close()


def test_aborted_is_resubmitted_and_error_keeps_its_place():
  ctl, mgr, submitted = _make(eta=0, batch=4, group=2)
  ctl.pump()
  n = len(submitted)
  ctl.on_trajectory(_finish(submitted[0], 0, reason="aborted"))
  assert len(submitted) == n + 1 and submitted[-1].request_id == submitted[0].request_id
  err = _finish(submitted[1], 0, reason="error")
  err.completion_tokens, err.logprobs, err.versions = (np.zeros(0, np.int32), np.zeros(0, np.float32),
                                                       np.zeros(0, np.int32))
  ctl.on_trajectory(err)
  for r in submitted[:n]:
    if r.request_id != submitted[1].request_id:
      ctl.on_trajectory(_finish(r, 0))
  b = ctl.next_batch(version=0, timeout=10)
  assert b.failed == 1 and len(b.sequences) == 3 and len(b.trajectories) == 4
  ctl.close()


def test_next_batch_times_out_without_data():
  ctl, _, _ = _make()
  assert ctl.next_batch(version=0, timeout=0.2) is None
  ctl.close()

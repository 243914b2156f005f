"""The controller with multi-turn episodes: every request carries the episode and its problem, the
environment's turn rewards are the trajectory's reward (attached to the right episode, once, however
often it is delivered), and in value mode each turn's reward sits on that turn's last action token."""

import numpy as np
import pytest

from asyncrl_jax.controller.controller import Controller
from asyncrl_jax.data.pipeline import PromptStream
from asyncrl_jax.rl.staleness import StalenessManager
from asyncrl_jax.rl.trajectory import Trajectory, Turn
from asyncrl_jax.tokenization import ToolTokenizer

TOK = ToolTokenizer()
EPISODE = {"env": "tools", "options": {"call_open": "[", "call_close": "]"}, "max_turns": 3}


def _source(n=32):
  return [{"question": f"{i}+{i}=".encode(), "answer": str(2 * i).encode(), "solution": b""}
          for i in range(n)]


def _make(advantage="group"):
  submitted = []
  mgr = StalenessManager(batch_size=4, max_staleness=0, max_concurrent=100)
  ctl = Controller(prompts=PromptStream(_source(), seed=0, shard_index=0, shard_count=1), tokenizer=TOK,
                   submit=lambda *r: submitted.extend(r), manager=mgr, version=lambda: 0,
                   reward=lambda text, answer: pytest.fail("episodes are scored by their environments"),
                   batch_size=4, group_size=2, max_new_tokens=40, advantage=advantage,
                   reward_source="environment", episode=EPISODE)
  return ctl, submitted


def _episode(req, turn_rewards):
  """A two-part episode: a call ``[..]``, the observation ``{..}`` (context), then ``#..`` (or only
  the final action when one reward is given)."""
  call, observation, answer = TOK.encode("[1+1]"), TOK.encode("{2}"), TOK.encode("#2") + [TOK.eos_id]
  if len(turn_rewards) == 1:
    tokens, mask = answer, [1] * len(answer)
    turns = (Turn(action=(0, len(answer)), observation=(len(answer),) * 2, reward=turn_rewards[0]),)
  else:
    tokens = call + observation + answer
    mask = [1] * len(call) + [0] * len(observation) + [1] * len(answer)
    a = len(call) + len(observation)
    turns = (Turn(action=(0, len(call)), observation=(len(call), a), reward=turn_rewards[0]),
             Turn(action=(a, len(tokens)), observation=(len(tokens),) * 2, reward=turn_rewards[1]))
  n = len(tokens)
  versions = np.where(np.asarray(mask) == 1, 0, -1)
  return Trajectory(trajectory_id=req.request_id, prompt_id=req.prompt_id, group_id=req.group_id,
                    prompt_tokens=np.asarray(req.prompt_tokens, np.int32),
                    completion_tokens=np.asarray(tokens, np.int32),
                    logprobs=np.where(versions >= 0, -0.5, 0.0).astype(np.float32),
                    versions=versions.astype(np.int32), finish_reason="eos", logprob_source="sampling",
                    sampling={}, tokenizer_id=TOK.identity, action_mask=np.asarray(mask, np.int32),
                    turns=turns)


def test_requests_carry_the_episode_and_rewards_come_from_the_turns():
  ctl, submitted = _make()
  ctl.pump()
  assert len(submitted) == 4
  for r in submitted:
    assert r.episode["env"] == "tools" and r.episode["max_turns"] == 3
    group = ctl._groups[r.group_id]  # pylint: disable=protected-access
    assert r.episode["problem"] == {"question": group.prompt.question, "answer": group.prompt.answer}
  rewards = {submitted[0].request_id: [0.25, 1.0], submitted[1].request_id: [0.0],
             submitted[2].request_id: [0.5, 0.0], submitted[3].request_id: [1.0]}
  for r in reversed(submitted):  # delivered out of order, and the first one twice
    ctl.on_trajectory(_episode(r, rewards[r.request_id]))
  ctl.on_trajectory(_episode(submitted[0], [0.0, 0.0]))  # a duplicate that would score differently
  batch = ctl.next_batch(version=0, timeout=10)
  assert ctl.duplicates == 1
  by_id = {t.trajectory_id: (t, r) for t, r in zip(batch.trajectories, batch.rewards)}
  for rid, turn_rewards in rewards.items():
    t, r = by_id[rid]
    assert r == pytest.approx(sum(turn_rewards)) and t.reward_source == "environment"
  # group advantages over the episode rewards; none on the observation tokens
  seq = batch.sequences[0]
  p = len(submitted[0].prompt_tokens)
  completion = seq.advantages[p:p + 10]
  mask = seq.mask[p:p + 10]
  assert np.all(completion[mask == 0] == 0) and np.all(completion[mask == 1] == pytest.approx(0.625))
  ctl.close()


def test_value_mode_puts_each_turn_reward_on_its_last_action_token():
  ctl, submitted = _make(advantage="value")
  ctl.pump()
  for r in submitted:
    ctl.on_trajectory(_episode(r, [0.25, 1.0] if r is submitted[0] else [1.0]))
  batch = ctl.next_batch(version=0, timeout=10)
  seq = batch.sequences[0]
  p = len(submitted[0].prompt_tokens)
  rewards = seq.advantages[p:]
  # "[1+1]" ends at completion token 4 (reward 0.25), "#2<eos>" at token 10 (reward 1.0)
  expected = np.zeros(11, np.float32)
  expected[4], expected[10] = 0.25, 1.0
  np.testing.assert_allclose(rewards[:11], expected)
  # negative control: a single-turn trajectory's reward still sits on its last token alone
  single = batch.sequences[1]
  assert single.advantages[-1] == pytest.approx(1.0) and single.advantages[:-1].sum() == 0
  ctl.close()

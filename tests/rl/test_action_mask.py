"""Tokens the policy did not sample (an environment's observation inside a completion) are context:
no loss, no advantage, no count, and nothing about them (their log-prob, their version) moves the
loss or its gradient. The checks a trajectory must pass apply to its actions, and its context
tokens may carry neither a log-prob nor a version."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fixtures.helpers import sharp_params
from asyncrl_jax import models
from asyncrl_jax.controller.checks import check_trajectory
from asyncrl_jax.rl import batching
from asyncrl_jax.rl.logprobs import compute_logprobs
from asyncrl_jax.rl.objective import LossSettings, micro_batch_loss
from asyncrl_jax.rl.trajectory import RolloutRequest, Trajectory, Turn
from asyncrl_jax.rollout import protocol

CFG = models.ModelConfig(vocab_size=23, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, max_seq_len=64)
PROMPT = [1, 5, 6]
COMPLETION = [7, 8, 9, 10, 11, 12, 13, 14]  # an action, an observation (10, 11), an action
MASK = [1, 1, 1, 0, 0, 1, 1, 1]


def _trajectory(mask=MASK, logprobs=None, versions=None):
  shape = np.asarray(MASK if mask is None else mask) == 1
  logprobs = np.where(shape, -0.5, 0.0) if logprobs is None else logprobs
  versions = np.where(shape, 3, -1) if versions is None else versions
  return Trajectory("t", "p", 0, np.asarray(PROMPT, np.int32), np.asarray(COMPLETION, np.int32),
                    np.asarray(logprobs, np.float32), np.asarray(versions, np.int32), "eos", "sampling",
                    {"min_new_tokens": 0}, "tok", action_mask=None if mask is None else np.asarray(mask))


def test_context_tokens_get_no_mask_no_advantage_and_count_for_nothing():
  s = batching.make_sequence(PROMPT, COMPLETION, advantage=2.0, action_mask=MASK)
  assert s.mask.tolist() == [0, 0, 0] + MASK
  assert s.advantages.tolist() == [0, 0, 0] + [2.0 * m for m in MASK]
  (packed,) = batching.pack_sequences([s], 64)
  assert batching.total_policy_tokens([packed]) == 6
  with pytest.raises(ValueError, match="8 completion tokens but an action mask of 3"):
    batching.make_sequence(PROMPT, COMPLETION, action_mask=[1, 0, 1])


def _loss_and_grad(params, sequence):
  (b,) = batching.pack_sequences([sequence], 64)
  b = jax.tree.map(jnp.asarray, b)
  prox = compute_logprobs(CFG, jax.tree.map(lambda x: x * 0.9, params), b.tokens, b.positions, b.segment_ids)
  settings = LossSettings(loss="decoupled_ppo", eps_clip=0.2, eps_low=0.3, eps_high=0.5)
  return jax.value_and_grad(lambda q: micro_batch_loss(q, b, prox, jnp.sum(b.mask), model=CFG,
                                                       settings=settings)[0])(params)


@pytest.mark.parametrize("mask,moves", [(MASK, False), ([1] * 8, True)])
def test_nothing_about_context_tokens_moves_the_loss(mask, moves):
  """The context tokens' behaviour log-probs and versions changed: with them masked, the loss and
  gradient are the same to the bit; as actions (the negative control), both change."""
  params = sharp_params(CFG, 0)
  behav = np.full(8, -0.7, np.float32)
  seq = lambda logp: batching.make_sequence(PROMPT, COMPLETION, logprobs=logp, versions=np.full(8, 3),
                                            advantage=1.5, action_mask=mask)
  moved = behav.copy()
  moved[3:5] = -4.0  # tokens 10 and 11
  (l1, g1), (l2, g2) = _loss_and_grad(params, seq(behav)), _loss_and_grad(params, seq(moved))
  same = float(l1) == float(l2) and all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(g1),
                                                                             jax.tree.leaves(g2)))
  assert same is not moves


def test_the_checks_read_the_actions_and_refuse_sampled_looking_context():
  request = RolloutRequest(prompt_tokens=PROMPT, max_new_tokens=16)
  ok = dict(vocab_size=CFG.vocab_size, newest_version=3)
  assert check_trajectory(_trajectory(), request, **ok) == ""  # context at version -1 is fine
  assert check_trajectory(_trajectory(mask=None), request, **ok) != ""  # (as actions, -1 is not)
  assert "context tokens" in check_trajectory(
      _trajectory(logprobs=np.full(8, -0.5)), request, **ok)
  assert "no action" in check_trajectory(_trajectory(mask=[0] * 8, versions=np.full(8, -1),
                                                     logprobs=np.zeros(8)), request, **ok)
  assert "not 0/1" in check_trajectory(_trajectory(mask=[2] * 8), request, **ok)
  with pytest.raises(ValueError, match="an action mask of 3"):
    _trajectory(mask=[1, 1, 1], logprobs=np.full(8, -0.5), versions=np.full(8, 3))


def test_the_action_mask_crosses_the_wire_and_none_stays_none():
  for t in (_trajectory(), _trajectory(mask=None, versions=np.full(8, 3), logprobs=np.full(8, -0.5))):
    back = protocol.trajectory_from_pb(protocol.trajectory_to_pb(t))
    assert back.finish_reason == "eos"
    if t.action_mask is None:
      assert back.action_mask is None and back.actions.all()
    else:
      assert back.action_mask.tolist() == MASK and back.actions.tolist() == [m == 1 for m in MASK]


def test_episodes_and_turns_cross_the_wire():
  turns = (Turn(action=(0, 3), observation=(3, 5), reward=0.25, latency=0.1, info={"tool": "calculator"}),
           Turn(action=(5, 8), observation=(8, 8), reward=1.0, ended="eos"))
  t = _trajectory()
  t.turns = turns
  t.finish_reason = "env_done"
  back = protocol.trajectory_from_pb(protocol.trajectory_to_pb(t))
  assert back.turns == turns and back.finish_reason == "env_done" and back.episode_reward == 1.25
  assert all(isinstance(turn, Turn) for turn in back.turns)
  assert protocol.trajectory_from_pb(protocol.trajectory_to_pb(_trajectory())).turns is None
  request = RolloutRequest(prompt_tokens=[1, 2], max_new_tokens=9, request_id="r",
                           episode={"env": "tools", "options": {"tool": "calculator"},
                                    "problem": {"question": "1+1=", "answer": "2"}, "max_turns": 3})
  assert protocol.request_from_pb(protocol.request_to_pb(request)).episode == request.episode
  plain = RolloutRequest(prompt_tokens=[1, 2], max_new_tokens=9, request_id="s")
  assert protocol.request_from_pb(protocol.request_to_pb(plain)).episode is None
  # a message whose turns are not a list of turns becomes a failed trajectory naming the field
  message = protocol.trajectory_to_pb(t)
  for bad_turns, field in [('{"action": 1}', "turns_json"), ('[{"action": [0, 3]}]', "observation"),
                           ('[{"action": [0, 3], "observation": [3, 3], "reward": "x"}]', "reward"),
                           ('[{"action": [0, true], "observation": [3, 3]}]', "action")]:
    message.turns_json = bad_turns
    failed = protocol.trajectory_from_pb(message)
    assert failed.finish_reason == "error" and "turns_json" in failed.error and field in failed.error
  bad = protocol.request_to_pb(request)
  bad.episode_json = "[1]"
  with pytest.raises(ValueError, match="episode_json"):
    protocol.request_from_pb(bad)


def test_the_checks_read_an_episodes_turns():
  request = RolloutRequest(prompt_tokens=PROMPT, max_new_tokens=16, request_id="t",
                           episode={"env": "tools", "problem": {}})
  good = (Turn(action=(0, 3), observation=(3, 5)), Turn(action=(5, 8), observation=(8, 8), reward=1.0))
  check = lambda t: check_trajectory(t, request, vocab_size=CFG.vocab_size, newest_version=3)  # noqa: E731
  t = _trajectory()
  t.turns = good
  assert check(t) == ""
  for turns, problem in [
      (None, "no turns"),
      ((good[0],), "cover 5 of 8"),
      ((good[0], Turn(action=(6, 8), observation=(8, 8))), "do not follow on"),
      ((Turn(action=(0, 4), observation=(4, 5)), good[1]), "mask disagrees"),
      (({"action": [0, 3]}, good[1]), "not a Turn"),
  ]:
    t.turns = turns
    assert problem in check(t), turns
  plain = RolloutRequest(prompt_tokens=PROMPT, max_new_tokens=16, request_id="t")
  t.turns = good
  assert "single-turn" in check_trajectory(t, plain, vocab_size=CFG.vocab_size, newest_version=3)

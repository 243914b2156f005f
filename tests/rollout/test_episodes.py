"""Multi-turn episodes on the decode server: actions cut at the environment's stop sequence, slots
parked while environments step, observations appended to the cache as context, every turn and finish
reason recorded, and the recorded log-probs those of the policy on exactly the context it saw."""

import threading
import time

import jax
import numpy as np
import pytest

from tests.fixtures.helpers import sharp_params
from asyncrl_jax import models
from asyncrl_jax.controller.checks import _check_turns
from asyncrl_jax.envs.base import StepResult, register
from asyncrl_jax.infra import sharding
from asyncrl_jax.rl.logprobs import compute_logprobs
from asyncrl_jax.rollout import DecodeServer, Engine, RolloutRequest, SamplingSettings
from asyncrl_jax.tokenization import ArithmeticTokenizer

CFG = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=96)
TOK = ArithmeticTokenizer()
SLEEPS = []  # (start, end) of every environment step that slept


@register("episode-echo")
class EchoEnv:
  """Ends an action at ';' and answers '55=' (reward 0.25 a turn); a final action (at the end of
  sequence) scores 1. Options: ``sleep`` before answering, ``fail_at`` (raise at that turn),
  ``done_at`` (end the episode at that turn)."""

  def __init__(self, sleep=0.0, fail_at=0, done_at=0, observation="55="):
    self.stop, self.sleep, self.fail_at, self.done_at = (";",), sleep, fail_at, done_at
    self.observation, self.turn = observation, 0

  def reset(self, problem):
    return problem.get("question", "")

  def step(self, action):
    self.turn += 1
    if self.sleep:
      t0 = time.time()
      time.sleep(self.sleep)
      SLEEPS.append((t0, time.time()))
    if self.turn == self.fail_at:
      raise RuntimeError("the tool crashed")
    if not action.endswith(";"):
      return StepResult(reward=1.0, done=True, info={"ended": "answer"})
    return StepResult(observation=self.observation, reward=0.25, done=self.turn == self.done_at)


@pytest.fixture(scope="module")
def params_a():
  return sharp_params(CFG, 0, 1.0)


@pytest.fixture(scope="module")
def params_b():
  return sharp_params(CFG, 1, 1.0)


def _server(params, slots=4, steps_per_call=4, **options):
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(CFG, mesh=mesh, num_slots=slots, max_prefill_length=16, max_target_length=96,
                  sampling=SamplingSettings(temperature=1.0), params=params, seed=3, tokenizer=TOK,
                  background_compile=False)
  return DecodeServer(engine, params, steps_per_call=steps_per_call, **options)


def _episodes(n, max_new=60, max_turns=4, seed=0, **env_options):
  rng = np.random.default_rng(seed)
  return [RolloutRequest(prompt_tokens=[1] + list(rng.integers(3, 17, 4)), max_new_tokens=max_new,
                         prompt_id=f"p{i}", group_id=i,
                         episode={"env": "episode-echo", "options": env_options,
                                  "problem": {"question": "1+2="}, "max_turns": max_turns})
          for i in range(n)]


def _until_parked(server):
  """Drives the loop until an episode's slot is parked for its environment."""
  for _ in range(200):
    server.iteration()
    if any(b is not None and b.waiting and not b.starting for b in server._slots):  # pylint: disable=protected-access
      return
  pytest.fail("no episode parked")


def _drain(server):
  out = []
  while not server.finished.empty():
    out.append(server.finished.get())
  return sorted(out, key=lambda t: t.prompt_id)


def _replay(params, t, drop_observations=False):
  """Log-probs of every completion token given everything before it (observations included, or,
  the negative control, left out of the context)."""
  keep = np.ones(len(t.completion_tokens), bool) if not drop_observations else t.actions
  seq = np.concatenate([t.prompt_tokens, t.completion_tokens[keep]])[None]
  lp = np.asarray(compute_logprobs(CFG, params, seq, np.arange(seq.shape[1])[None], np.ones_like(seq)))
  out = np.zeros(len(t.completion_tokens), np.float32)
  out[keep] = lp[0, len(t.prompt_tokens):]
  return out


def test_turns_masks_and_alignment(params_a):
  server = _server(params_a)
  server.submit(*_episodes(16))
  server.run_until_idle()
  trajectories = _drain(server)
  assert len(trajectories) == 16
  observation = TOK.encode("55=")
  multi = 0
  for t in trajectories:
    assert t.finish_reason in ("eos", "length", "turns"), (t.finish_reason, t.error)
    mask = t.actions
    assert len(t.turns) >= 1
    for k, turn in enumerate(t.turns):
      a0, a1 = turn.action
      o0, o1 = turn.observation
      assert mask[a0:a1].all() and not mask[o0:o1].any()
      if turn.ended == "stop":  # the action ends exactly at the stop sequence
        assert TOK.decode(t.completion_tokens[a1 - 1:a1]) == ";"
        assert ";" not in TOK.decode(t.completion_tokens[a0:a1 - 1])
      if o1 > o0:
        assert t.completion_tokens[o0:o1].tolist() == observation
        assert turn.reward == 0.25
        assert k + 1 < len(t.turns) or t.finish_reason == "length"
    assert (t.versions[~mask] == -1).all() and (t.logprobs[~mask] == 0).all()
    assert (t.versions[mask] == 0).all()
    if t.finish_reason == "eos":
      assert t.turns[-1].reward == 1.0 and t.turns[-1].ended == "eos"
      assert t.episode_reward == pytest.approx(1.0 + 0.25 * (len(t.turns) - 1))
    if t.finish_reason == "turns":
      assert len(t.turns) == 4
    multi += (~mask).any()
    # alignment: each action token's recorded log-prob is the policy's on the context it saw
    np.testing.assert_allclose(t.logprobs[mask], _replay(params_a, t)[mask], atol=2e-3)
  assert multi >= 3, "too few episodes had an observation for the test to mean anything"
  # negative control: without the observations in the context, the later actions' log-probs differ
  t = next(t for t in trajectories if (~t.actions).any() and t.turns[-1].action[1] >
           t.turns[-1].action[0] + 1)
  later = np.arange(len(t.completion_tokens)) >= t.turns[1].action[0]
  wrong = _replay(params_a, t, drop_observations=True)
  assert np.abs(wrong[later & t.actions] - t.logprobs[later & t.actions]).max() > 1e-2
  stats = server.stats
  assert stats.env_steps == sum(turn.ended in ("stop", "eos") for t in trajectories for turn in t.turns)
  assert stats.env_errors == 0


def test_weight_update_while_parked_re_prefills_the_context(params_a, params_b):
  """Episodes parked for a slow environment when new weights arrive: their contexts (observations
  included) are re-prefilled under the new weights, and every action token's log-prob is that of
  the version recorded with it."""
  server = _server(params_a)
  server.submit(*_episodes(4, seed=2, sleep=0.3))
  _until_parked(server)
  server.update_weights(params_b, version=1)
  server.run_until_idle()
  trajectories = _drain(server)
  assert server.stats.interrupted_sequences >= 1
  changed = 0
  for t in trajectories:
    mask = t.actions
    params = {0: params_a, 1: params_b}
    for v in (0, 1):
      sel = mask & (t.versions == v)
      if sel.any():
        np.testing.assert_allclose(t.logprobs[sel], _replay(params[v], t)[sel], atol=2e-3)
    changed += (t.versions[mask] == 0).any() and (t.versions[mask] == 1).any()
  assert changed >= 1


def test_slots_decode_on_while_one_episode_waits(params_a):
  server = _server(params_a, slots=2, steps_per_call=1)
  slow = _episodes(1, max_new=60, max_turns=2, seed=4, sleep=1.5)
  single = [RolloutRequest(prompt_tokens=[1, 4, 5], max_new_tokens=30, prompt_id=f"s{i}", group_id=10 + i)
            for i in range(3)]
  SLEEPS.clear()
  server.submit(*slow, *single)
  server.start()
  deadline = time.time() + 60
  got = []
  while len(got) < 4 and time.time() < deadline:
    got.append(server.finished.get(timeout=60))
  server.stop()
  episode = next(t for t in got if t.prompt_id == "p0")
  others = [t for t in got if t.prompt_id != "p0"]
  waits = [turn for turn in episode.turns if turn.latency > 1.0]
  assert waits, episode.turns
  # single-turn requests (in the other slot) finished while the episode's slot was parked
  inside = [t for t in others if any(a < t.finished_at < b for a, b in SLEEPS)]
  assert inside, (SLEEPS, [t.finished_at for t in others])


@pytest.mark.parametrize("options,reason,error", [
    (dict(fail_at=1), "env_error", "the tool crashed"),
    (dict(sleep=2.0), "env_timeout", "no answer within"),
    (dict(done_at=1), "env_done", ""),
])
def test_environment_failures_end_the_episode_not_the_run(params_a, options, reason, error):
  server = _server(params_a, env_timeout=0.5)
  requests = _episodes(6, seed=6, **options)
  server.submit(*requests)
  server.run_until_idle(max_iterations=100_000)
  trajectories = _drain(server)
  assert len(trajectories) == 6 and server.error is None
  ended = [t for t in trajectories if t.finish_reason == reason]
  # an episode whose first action was final (ended at the end of sequence) never sees the fault
  assert ended and all(t.finish_reason in (reason, "eos", "length") for t in trajectories)
  for t in ended:
    assert error in t.error and error in t.turns[-1].error
    assert t.turns[-1].observation[0] == t.turns[-1].observation[1]  # nothing appended
  # the server serves on: a plain request after the failures
  server.submit(RolloutRequest(prompt_tokens=[1, 4], max_new_tokens=5, prompt_id="after"))
  server.run_until_idle()
  (after,) = _drain(server)
  assert after.finish_reason in ("eos", "length")


def test_budget_and_unknown_environment(params_a):
  server = _server(params_a)
  (short,) = _episodes(1, max_new=6, seed=8)
  bad = RolloutRequest(prompt_tokens=[1, 4], max_new_tokens=10, prompt_id="bad",
                       episode={"env": "no-such-env", "problem": {}})
  server.submit(short, bad)
  server.run_until_idle()
  by_id = {t.prompt_id: t for t in _drain(server)}
  assert by_id["bad"].finish_reason == "env_error" and "no-such-env" in by_id["bad"].error
  assert by_id["p0"].finish_reason in ("length", "eos")
  assert len(by_id["p0"].completion_tokens) <= 6


def test_stop_versus_budget(params_a):
  """An action that reaches the token budget ends the episode as "length" with exactly the budget
  used; one that ends at the end of sequence is a natural stop ("eos"), scored by the environment."""
  server = _server(params_a)
  requests = _episodes(12, max_new=8, max_turns=4, seed=9)
  server.submit(*requests)
  server.run_until_idle()
  trajectories = _drain(server)
  reasons = {t.finish_reason for t in trajectories}
  assert reasons <= {"eos", "length"} and "length" in reasons
  for t, r in zip(trajectories, sorted(requests, key=lambda r: r.prompt_id)):
    assert _check_turns(t, r) == "", (t.turns, len(t.completion_tokens))  # an action cut short too
    if t.finish_reason == "length":
      dropped = t.turns and t.turns[-1].info.get("dropped_observation_tokens")
      assert len(t.completion_tokens) == 8 or dropped, (t.completion_tokens, t.turns)
      assert t.episode_reward == pytest.approx(0.25 * sum(turn.ended == "stop" for turn in t.turns))
    else:
      assert t.completion_tokens[-1] == TOK.eos_id and t.turns[-1].ended == "eos"
      assert t.turns[-1].reward == 1.0


def test_a_restart_drops_parked_episodes_and_their_late_answers(params_a, params_b):
  """A new learner's weights (restart) drop the episodes in flight, parked ones included; the
  environment's answer that arrives afterwards is dropped too, and the slots serve the new work."""
  server = _server(params_a)
  server.submit(*_episodes(4, seed=2, sleep=0.5))
  _until_parked(server)
  server.update_weights(params_b, version=0, restart=True)
  server.iteration()
  assert server.num_active == 0
  time.sleep(0.8)  # the parked episodes' environments answer now
  fresh = _episodes(2, seed=3)
  server.submit(*fresh)
  server.run_until_idle()
  got = _drain(server)
  assert sorted(t.trajectory_id for t in got) == sorted(r.request_id for r in fresh)
  assert all((t.versions[t.actions] == 0).all() for t in got)

"""Every path that ends an episode closes its environment exactly once: a final answer, the
environment ending it, the turn limit, the token budget, a step that fails or times out, an abort,
a restarted learner's weights, the server stopping, an environment that fails to start, and an
episode aborted while its environment was still starting. A counting environment records every
instance built and every ``close``."""

import threading
import time

import jax
import numpy as np
import pytest

from tests.fixtures.helpers import sharp_params
from asyncrl_jax import models
from asyncrl_jax.envs.base import StepResult, register
from asyncrl_jax.infra import sharding
from asyncrl_jax.rollout import DecodeServer, Engine, RolloutRequest, SamplingSettings
from asyncrl_jax.tokenization import ArithmeticTokenizer

CFG = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=96)
TOK = ArithmeticTokenizer()
BUILT: list = []  # every CountingEnv made
ANY = "0123456789+=;#"  # every character a stop sequence: each action is one token
_LOCK = threading.Lock()


@register("close-counter")
class CountingEnv:
  """Ends an action at ';' (or any character of ``stop``) and answers '5=' (a final action scores
  1). Options: ``step_sleep``,
  ``fail_at`` (the step of that turn raises), ``done_at`` (the environment ends the episode at that
  turn), ``reset_sleep``, ``reset_fail``."""

  def __init__(self, step_sleep=0.0, fail_at=0, done_at=0, reset_sleep=0.0, reset_fail=False, stop=";"):
    self.stop = tuple(stop)  # each character a stop sequence
    self.step_sleep, self.fail_at, self.done_at = step_sleep, fail_at, done_at
    self.reset_sleep, self.reset_fail = reset_sleep, reset_fail
    self.turn, self.closed, self.close_threads = 0, 0, []
    with _LOCK:
      BUILT.append(self)

  def reset(self, problem):
    if self.reset_sleep:
      time.sleep(self.reset_sleep)
    self.reset_done_at = time.time()
    if self.reset_fail:
      raise RuntimeError("no sandbox today")
    return problem.get("question", "")

  def step(self, action):
    self.turn += 1
    if self.step_sleep:
      time.sleep(self.step_sleep)
    if self.turn == self.fail_at:
      raise RuntimeError("the tool crashed")
    if not action.endswith(self.stop):
      return StepResult(reward=1.0, done=True)
    return StepResult(observation="5=", reward=0.0, done=self.turn == self.done_at)

  def close(self):
    with _LOCK:
      self.closed += 1
      self.close_threads.append(threading.current_thread().name)


@pytest.fixture(scope="module")
def params():
  return sharp_params(CFG, 0, 1.0)


@pytest.fixture(autouse=True)
def _fresh():
  BUILT.clear()
  yield


def _server(params, slots=4, **options):
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(CFG, mesh=mesh, num_slots=slots, max_prefill_length=16, max_target_length=96,
                  sampling=SamplingSettings(temperature=1.0), params=params, seed=3, tokenizer=TOK,
                  background_compile=False)
  return DecodeServer(engine, params, steps_per_call=4, **options)


def _episodes(n, max_new=60, max_turns=4, seed=0, **options):
  rng = np.random.default_rng(seed)
  return [RolloutRequest(prompt_tokens=[1] + list(rng.integers(3, 17, 4)), max_new_tokens=max_new,
                         prompt_id=f"p{i}", group_id=i,
                         episode={"env": "close-counter", "options": options,
                                  "problem": {"question": "1+2="}, "max_turns": max_turns})
          for i in range(n)]


def _drain(server):
  out = []
  while not server.finished.empty():
    out.append(server.finished.get())
  return out


def _closed_once(expected_built=None, wait=5.0):
  """Every environment built was closed exactly once (closes run on pool workers: wait for them)."""
  deadline = time.time() + wait
  while time.time() < deadline and any(e.closed == 0 for e in BUILT):
    time.sleep(0.02)
  time.sleep(0.1)  # a second close, if there were one, would land now
  if expected_built is not None:
    assert len(BUILT) == expected_built, len(BUILT)
  assert BUILT, "no environment was built: the test checks nothing"
  assert [e.closed for e in BUILT] == [1] * len(BUILT), [e.closed for e in BUILT]
  assert all(name.startswith("env") for e in BUILT for name in e.close_threads)  # off the loop thread


def _until(server, predicate, n=400):
  for _ in range(n):
    server.iteration()
    if predicate():
      return
    time.sleep(0.005)
  pytest.fail("the server never reached the state the test needs")


def _parked(server):
  return any(b is not None and b.waiting and not b.starting for b in server._slots)  # pylint: disable=protected-access


@pytest.mark.parametrize("options,max_new,max_turns,reasons", [
    (dict(stop=ANY), 60, 2, {"eos", "turns"}),  # answers and the turn limit
    (dict(stop=ANY, done_at=1), 60, 4, {"env_done", "eos"}),
    (dict(stop=ANY, fail_at=1), 60, 4, {"env_error", "eos"}),
    (dict(stop=ANY, step_sleep=1.0), 60, 4, {"env_timeout", "eos"}),
    ({}, 6, 4, {"length", "eos"}),  # the budget
])
def test_finishing_paths_close_once(params, options, max_new, max_turns, reasons):
  server = _server(params, env_timeout=0.3)
  server.submit(*_episodes(8, max_new=max_new, max_turns=max_turns, seed=1, **options))
  server.run_until_idle(max_iterations=100_000)
  got = _drain(server)
  assert len(got) == 8 and {t.finish_reason for t in got} <= reasons
  assert {t.finish_reason for t in got} - {"eos"}, "no episode took the path under test"
  _closed_once(8)


def test_an_abort_of_a_parked_episode_closes_it_once(params):
  server = _server(params)
  requests = _episodes(4, seed=2, step_sleep=0.5)
  server.submit(*requests)
  _until(server, lambda: _parked(server))
  parked = next(b for b in server._slots if b is not None and b.waiting)  # pylint: disable=protected-access
  server.abort(parked.request.request_id, "the controller gave up")
  server.run_until_idle(max_iterations=100_000)
  got = {t.trajectory_id: t for t in _drain(server)}
  assert got[parked.request.request_id].finish_reason == "aborted"
  _closed_once(4)


def test_a_restart_closes_the_dropped_episodes_once(params):
  server = _server(params)
  server.submit(*_episodes(4, seed=2, step_sleep=0.5))
  _until(server, lambda: _parked(server))
  server.update_weights(params, version=0, restart=True)
  server.run_until_idle(max_iterations=100_000)
  _closed_once()


def test_stopping_the_server_closes_the_episodes_in_flight_once(params):
  server = _server(params)
  server.submit(*_episodes(4, seed=2, step_sleep=0.5))
  server.start()
  deadline = time.time() + 30
  while not _parked(server) and time.time() < deadline:
    time.sleep(0.01)
  server.stop()
  _closed_once()


def test_an_environment_that_fails_to_start_is_closed_once(params):
  server = _server(params)
  server.submit(*_episodes(3, reset_fail=True))
  server.run_until_idle(max_iterations=100_000)
  got = _drain(server)
  assert [t.finish_reason for t in got] == ["env_error"] * 3
  assert all("did not start" in t.error and "no sandbox today" in t.error for t in got)
  _closed_once(3)


def test_an_episode_aborted_while_its_environment_starts_closes_it_once(params):
  server = _server(params)
  (request,) = _episodes(1, reset_sleep=0.5)
  server.submit(request)
  server.iteration()
  assert any(b is not None and b.starting for b in server._slots)  # pylint: disable=protected-access
  server.abort(request.request_id, "gone")
  server.run_until_idle(max_iterations=100_000)
  (t,) = _drain(server)
  assert t.finish_reason == "aborted"
  _closed_once(1, wait=3.0)


def test_a_slow_start_does_not_hold_up_the_other_slots(params):
  """An environment whose reset takes 1 s starts off the loop: single-turn requests in the other
  slot finish meanwhile (make and reset ran on the loop's thread before)."""
  server = _server(params, slots=2)
  server.submit(RolloutRequest(prompt_tokens=[1, 4, 5], max_new_tokens=20, prompt_id="warm-up"))
  server.run_until_idle()  # (compiles the programs first)
  _drain(server)
  (slow,) = _episodes(1, reset_sleep=1.0)
  single = [RolloutRequest(prompt_tokens=[1, 4, 5], max_new_tokens=20, prompt_id=f"s{i}") for i in range(3)]
  server.submit(slow, *single)
  server.start()
  got = [server.finished.get(timeout=60) for _ in range(4)]
  server.stop()
  (env,) = BUILT
  singles = [t for t in got if t.prompt_id.startswith("s")]
  assert len(singles) == 3
  assert all(t.finished_at < env.reset_done_at for t in singles), \
      ([t.finished_at for t in singles], env.reset_done_at)
  _closed_once(1)

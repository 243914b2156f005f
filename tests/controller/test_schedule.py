"""When weights go to the decode servers (``controller/schedule.py``), driven against a fake backend:
bounded staleness publishes every version at once; pinned staleness holds a version back until the
rollouts admitted under the published weights are in, and then publishes the newest."""

import types

from tests.fixtures.fakes import FakeBackend
from asyncrl_jax.controller.schedule import PublishSchedule


def _schedule(mode: str, settled=lambda v: True):
  config = types.SimpleNamespace(rl=types.SimpleNamespace(staleness_mode=mode))
  learner = types.SimpleNamespace(version=0, params="w0")
  controller = types.SimpleNamespace(settled=settled)
  backend = FakeBackend()
  return PublishSchedule(config, backend, controller, learner), backend, learner


def test_bounded_publishes_every_version_and_sums_what_it_cost():
  schedule, backend, learner = _schedule("bounded")
  for v in (1, 2, 3):
    learner.version, learner.params = v, f"w{v}"
    schedule.publish()
  assert backend.pushed == [1, 2, 3] and not schedule.behind
  stats = schedule.take()
  assert (stats.seconds, stats.bytes) == (1.5, 300)
  assert (schedule.take().seconds, schedule.take().bytes) == (0.0, 0)  # (taken once)
  assert schedule.rollout_params() == "w3"  # the decode server's copy, in this process


def test_pinned_waits_for_the_published_versions_rollouts_then_publishes_the_newest():
  settled_at = set()
  schedule, backend, learner = _schedule("pinned", settled=lambda v: v in settled_at)
  learner.version, learner.params = 1, "w1"
  schedule.publish()
  assert backend.pushed == [] and schedule.behind
  assert schedule.rollout_params() is None  # the servers hold older weights than the learner
  learner.version, learner.params = 2, "w2"
  settled_at.add(0)  # every rollout admitted under version 0 is in
  schedule.publish()
  assert backend.pushed == [2] and schedule.published == 2 and not schedule.behind
  assert schedule.rollout_params() == "w2"

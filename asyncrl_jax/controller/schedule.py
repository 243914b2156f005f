"""When the learner's weights go to the decode servers: after every version (``rl.staleness_mode=
"bounded"``), or only once the rollouts admitted under the published weights are all in (``"pinned"``,
see ``rl.staleness``). The main loop (``train``) asks; the rollout backend (``rollout.backend``'s
interface) moves the weights."""

from __future__ import annotations

from asyncrl_jax.weights import TransferStats


class PublishSchedule:
  """Hands the learner's weights to the decode servers after each version: at once
  (``rl.staleness_mode="bounded"``), or, pinned, only once every rollout admitted under the weights
  they hold has finished (``rl.staleness``'s module docstring); the learner then trains no version
  that is not published yet."""

  def __init__(self, config, backend, controller, learner):
    self.pinned = config.rl.staleness_mode == "pinned"
    self.backend, self.controller, self.learner = backend, controller, learner
    self.published = learner.version  # (the backend starts with the learner's weights)
    self._seconds, self._bytes = 0.0, 0  # of the publishes since the last ``take``

  @property
  def behind(self) -> bool:
    """The learner holds weights the decode servers were not sent yet (pinned only)."""
    return self.published < self.learner.version

  def publish(self) -> None:
    """Publishes the learner's version if the mode allows it now (pinned: once every rollout admitted
    under the published version has finished and been scored: ``Controller.settled``)."""
    if self.pinned and not self.controller.settled(self.published):
      return
    self.published = self.learner.version
    stats = self.backend.update_weights(self.learner.params, self.learner.version)
    self._seconds += stats.seconds
    self._bytes += stats.bytes

  def take(self) -> TransferStats:
    """The publishes since the last call, summed (a deferred one counts with the next version)."""
    stats = TransferStats(self._seconds, self._bytes)
    self._seconds, self._bytes = 0.0, 0
    return stats

  def rollout_params(self):
    """The decode servers' copy of the learner's current weights, when they hold them (else None)."""
    return None if self.behind else self.backend.local_params()

"""The controller: admits prompts under the staleness bound, checks, scores and batches trajectories
(``controller``, ``checks``), and decides when weights are published (``schedule``)."""

from asyncrl_jax.controller.controller import Controller, TrainingBatch
from asyncrl_jax.controller.schedule import PublishSchedule

__all__ = ["Controller", "PublishSchedule", "TrainingBatch"]

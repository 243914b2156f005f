"""The learner: the jitted update (``updater``), the policy's learner and its critic, the learner's
processes acting as one (``group``), and the publishing of its weights (``publisher``)."""

from asyncrl_jax.learner.group import LearnerGroup
from asyncrl_jax.learner.learner import Learner, NonFiniteError
from asyncrl_jax.learner.publisher import WeightPublisher

__all__ = ["Learner", "LearnerGroup", "NonFiniteError", "WeightPublisher"]

"""The rollout side: a JetStream engine for our model, the RL decode server, streaming, serving."""

from asyncrl_jax.models.sampling import SamplingSettings
from asyncrl_jax.rl.trajectory import RolloutRequest, Trajectory
from asyncrl_jax.rollout.decode_loop import DecodeServer
from asyncrl_jax.rollout.engine import Engine

__all__ = ["Engine", "SamplingSettings", "DecodeServer", "RolloutRequest", "Trajectory"]

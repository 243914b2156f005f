"""The environment interface, and the registry that builds environments by name.

An episode starts from a problem (``reset``: the text the policy sees first). The policy then acts:
a completion that ends at one of the environment's ``stop`` sequences (for example the end of a tool
call) or at its own end-of-sequence. ``step(action)`` answers with a ``StepResult``: an observation
(text the next turn's context gets, never a policy action), a reward and whether the episode is done.
Environments are plain Python classes, registered under a name (``@register("name")``) and built with
``make(name, **options)``, so a user adds one without touching the engine. A step may raise or take
too long; ``pool.EnvironmentPool`` turns either into the end of that episode, never of the run.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What the environment answers to one action."""
  observation: str = ""  # appended to the context (not a policy action: no loss on it)
  reward: float = 0.0  # this turn's reward
  done: bool = False  # the episode ends here (the environment's own decision)
  info: dict = dataclasses.field(default_factory=dict)  # e.g. {"tool": "calculator", "error": "..."}


@runtime_checkable
class Environment(Protocol):
  """One episode's environment (a fresh instance per episode)."""

  stop: tuple  # stop sequences that end a policy action and hand the turn to the environment

  def reset(self, problem: dict) -> str:
    """Starts an episode on ``problem`` (e.g. ``{"question": ..., "answer": ...}``); returns the
    first context text."""

  def step(self, action: str) -> StepResult:
    """The environment's answer to the policy's action (its text, stop sequence included)."""


_REGISTRY: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
  """Class decorator: makes ``make(name, ...)`` build the class. A name is registered once."""
  def add(cls: type) -> type:
    if name in _REGISTRY and _REGISTRY[name] is not cls:
      raise ValueError(f"environment {name!r} is registered already (by {_REGISTRY[name].__qualname__})")
    _REGISTRY[name] = cls
    return cls
  return add


def names() -> list[str]:
  return sorted(_REGISTRY)


def make(name: str, **options) -> Environment:
  """A new environment of the class registered as ``name``, built with ``options``."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown environment {name!r}; registered: {names()}")
  env = _REGISTRY[name](**options)
  if not isinstance(env, Environment):
    raise TypeError(f"environment {name!r} ({type(env).__qualname__}) lacks stop, reset or step")
  return env

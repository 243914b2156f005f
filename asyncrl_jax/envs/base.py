"""The environment interface, and the registry that builds environments by name.

An episode starts from a problem (``reset``: the text the policy sees first). The policy then acts:
a completion that ends at one of the environment's ``stop`` sequences (for example the end of a tool
call) or at its own end-of-sequence. ``step(action)`` answers with a ``StepResult``: an observation
(text the next turn's context gets, never a policy action), a reward and whether the episode is done.
Environments are plain Python classes, registered under a name (``@register("name")``) and built with
``make(name, **options)``, so a user adds one without touching the engine. A step may raise or take
too long; ``pool.EnvironmentPool`` turns either into the end of that episode, never of the run.
An environment may also have ``close()``, called once (on a worker, with the step timeout) when its
episode ends for any reason.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Optional, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What the environment answers to one action."""
  # appended to the context (not a policy action: no loss on it): text, or token ids (e.g. a chat
  # template's markers, which text would not round-trip)
  observation: "str | list" = ""
  reward: float = 0.0  # this turn's reward
  done: bool = False  # the episode ends here (the environment's own decision)
  info: dict = dataclasses.field(default_factory=dict)  # e.g. {"tool": "calculator", "error": "..."}


class Action(str):
  """The text of a policy action, as ``step`` receives it (a ``str``), with its token ids
  (``tokens``) and how it ended (``ended``: ``"stop"`` at one of the environment's stop sequences,
  ``"eos"``, or ``"max_tokens"`` at the cap the environment set in ``max_action_tokens``)."""

  tokens: tuple = ()
  ended: str = ""

  def __new__(cls, text: str, tokens=(), ended: str = ""):
    self = super().__new__(cls, text)
    self.tokens, self.ended = tuple(int(t) for t in tokens), ended
    return self


@runtime_checkable
class Environment(Protocol):
  """One episode's environment (a fresh instance per episode)."""

  stop: tuple  # stop sequences that end a policy action and hand the turn to the environment

  def reset(self, problem: dict) -> "str | list":
    """Starts an episode on ``problem`` (e.g. ``{"question": ..., "answer": ...}``). The decode
    server calls it on a worker (with ``make``), within the step timeout, while the episode's slot
    waits. It returns the first context's text, and the policy starts from the request's prompt
    (the controller renders it from the problem as for every task); or a list of token ids, which
    is then the episode's prompt (an agent program's own first request, with its tools)."""

  def step(self, action: str) -> StepResult:
    """The environment's answer to the policy's action (its text, stop sequence included; an
    ``Action``, which also carries its tokens). An environment may set ``max_action_tokens`` (an
    int, or None) after ``reset`` or ``step``: the next action then ends at that many tokens."""


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


def make(name: str, context: Optional[dict] = None, **options) -> Environment:
  """A new environment of the class registered as ``name``, built with ``options``, and with those
  entries of ``context`` (what the caller holds, e.g. its ``tokenizer``) that its constructor takes
  by name."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown environment {name!r}; registered: {names()}")
  cls = _REGISTRY[name]
  accepted = inspect.signature(cls).parameters
  extra = {k: v for k, v in (context or {}).items() if k in accepted and k not in options}
  env = cls(**options, **extra)
  if not isinstance(env, Environment):
    raise TypeError(f"environment {name!r} ({type(env).__qualname__}) lacks stop, reset or step")
  return env

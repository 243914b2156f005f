"""Environments for multi-turn, tool-using episodes: the interface (``base``), the registry that builds
them by name, the worker pool that runs their steps off the decode loop with a timeout each
(``pool``), the built-in tools (``calculator``, ``python_tool``) with optional latency (``latency``)
for benchmarks, and agent programs written against an OpenAI-compatible client (``agent``, served by
``chat_endpoint``)."""

from asyncrl_jax.envs import agent, tools_env  # noqa: F401,E402  (registers the built-in environments)

import json  # noqa: E402
from typing import Optional  # noqa: E402

from asyncrl_jax.data import tool_arithmetic  # noqa: E402
from asyncrl_jax.envs.base import names  # noqa: E402


def episode_template(config) -> Optional[dict]:
  """What every rollout of a run with ``env.name`` set runs as (``RolloutRequest.episode`` without
  its problem): ``{"env", "options", "max_turns"}``; None for single-turn runs. The built-in tool
  task's markers come first, so ``env.options`` may override them."""
  env = config.env
  if not env.name:
    return None
  if env.name not in names():
    raise ValueError(f"env.name={env.name!r} is not a registered environment; registered: {names()}")
  builtin = config.data.task == "tool_arithmetic" and env.name == "tools"
  options = dict(tool_arithmetic.ENV_OPTIONS) if builtin else {}
  options.update(json.loads(env.options))
  return {"env": env.name, "options": options, "max_turns": int(env.max_turns)}

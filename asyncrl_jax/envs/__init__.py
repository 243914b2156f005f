"""Environments for multi-turn, tool-using episodes: the interface (``base``), the registry that builds
them by name, the worker pool that runs their steps off the decode loop with a timeout each
(``pool``), the built-in tools (``calculator``, ``python_tool``) with optional latency (``latency``)
for benchmarks, and agent programs written against an OpenAI-compatible client (``agent``, served by
``chat_endpoint``)."""

from asyncrl_jax.envs import agent, code_env, tools_env  # noqa: F401,E402  (registers the built-in environments)

import json  # noqa: E402
from typing import Optional  # noqa: E402

from asyncrl_jax.data import tool_arithmetic  # noqa: E402
from asyncrl_jax.envs.base import names  # noqa: E402
from asyncrl_jax.envs.sandbox import SandboxUnavailable  # noqa: E402,F401  (the run refuses with it)


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
  if env.name == "tools" and options.get("tool") == "python":
    options["allow_unsandboxed"] = bool(env.allow_unsandboxed)
  return {"env": env.name, "options": options, "max_turns": int(env.max_turns)}


def observation_markers(config) -> Optional[tuple]:
  """(open, close) around what the run's tool environment answers (the built-in ``tools``
  environment's ``result_open`` / ``result_close``), for demonstrations that show tool calls; None
  where the run has no such environment."""
  template = episode_template(config)
  if not template or template["env"] != "tools":
    return None
  from asyncrl_jax.envs import tools_env  # pylint: disable=import-outside-toplevel
  options = template["options"]
  return (options.get("result_open", tools_env.RESULT_OPEN), options.get("result_close", tools_env.RESULT_CLOSE))


def sandbox_status(config) -> Optional[dict]:
  """For a run that runs model code (episodes with the built-in Python tool, or a code task's reward):
  ``{"sandboxed": bool, "why": ...}``, checked once on this machine; None for runs without it. Raises
  ``sandbox.SandboxUnavailable`` when the sandbox cannot run and ``env.allow_unsandboxed`` is False,
  and always for a code task (its reward never runs a program unsandboxed)."""
  from asyncrl_jax.envs import sandbox  # pylint: disable=import-outside-toplevel
  template = episode_template(config)
  if config.data.task in ("code_jsonl", "code_functions") or (template and template["env"] == "code"):
    ok, why = sandbox.available()
    if not ok:
      raise sandbox.SandboxUnavailable(f"data.task={config.data.task!r} scores programs in the sandbox, "
                                       f"which cannot run on this machine ({why})")
    return {"sandboxed": True, "why": "", "interpreter": sandbox.interpreter()}
  if not template or template["env"] != "tools" or template["options"].get("tool") != "python":
    return None
  ok, why = sandbox.available()
  if not ok and not config.env.allow_unsandboxed:
    raise sandbox.SandboxUnavailable(
        f"the Python tool's sandbox cannot run on this machine ({why}); set "
        "--config.env.allow_unsandboxed=True to run model code with resource limits only")
  return {"sandboxed": ok, "why": why, "interpreter": sandbox.interpreter() if ok else None}

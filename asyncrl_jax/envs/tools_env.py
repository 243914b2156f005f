"""The built-in tool environment: the policy may call a tool between its reasoning steps, and its
final answer is scored like the built-in task's (the text after the last ``#``).

An action that ends with ``call_close`` after a ``call_open`` is a tool call: the text between them
goes to the tool, and the observation is ``result_open + output + result_close`` (a tool error is the
output ``error_output``, by default ``error: <why>``, and the episode goes on; a vocabulary without
letters sets it to ``""``). Any other action ends the episode with the reward of
the problem's answer. ``max_calls`` ends an episode that keeps calling (reward 0, ``info["ended"]``
says why). ``format="chat"`` reads and answers tool calls in the decode server's tokenizer's chat
format instead (``Tokenizer.parse_tool_calls``: Qwen2.5 / Hermes ``<tool_call>`` blocks naming the
tool, its argument ``expression`` or ``code``; the built-in vocabulary's ``[args]``), each answered by
a ``tool`` message the chat template renders: the tokens an agent program with the tool as an OpenAI
function produces through ``envs.agent``. ``latency`` (``lognormal:median=,sigma=``) waits a drawn time per call, for benchmarks of
slow environments (drawn per episode from ``seed`` and the episode's id). Tools: ``calculator``
(``envs.calculator``, computed in a worker process of ``envs.worker``, so that no call holds the
decode server's GIL), ``python`` (``envs.python_tool``: the code runs in the bubblewrap sandbox of
``envs.sandbox``; the output is its stdout, or its error).
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from typing import Optional

import numpy as np

from asyncrl_jax.data import arithmetic
from asyncrl_jax.envs import calculator, python_tool, worker
from asyncrl_jax.envs.base import StepResult, register
from asyncrl_jax.envs.latency import Latency

TOOLS = ("calculator", "python")
FORMATS = ("markers", "chat")
ARGUMENT = {"calculator": "expression", "python": "code"}  # a tool's one parameter, in the chat format
_WORKERS: dict = {}
_WORKERS_LOCK = threading.Lock()


def calculator_workers() -> worker.ToolWorkers:
  """This process's calculator worker processes (started at the first call)."""
  with _WORKERS_LOCK:
    if "calculator" not in _WORKERS:
      _WORKERS["calculator"] = worker.ToolWorkers(calculator.__file__, "calculate", workers=8, timeout=5.0)
    return _WORKERS["calculator"]


RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"  # around a tool's answer, by default


@register("tools")
class ToolEnvironment:
  """One episode of a tool-using problem (``{"question", "answer"}``)."""

  def __init__(self, tool: str = "calculator", call_open: str = "<calc>", call_close: str = "</calc>",
               result_open: str = RESULT_OPEN, result_close: str = RESULT_CLOSE, max_calls: int = 8,
               latency: str = "", seed: int = 0, python_limits: Optional[python_tool.Limits] = None,
               error_output: str = "error: {error}", episode_id: str = "",
               allow_unsandboxed: bool = False, constant_output: Optional[str] = None,
               format: str = "markers", tokenizer=None):  # pylint: disable=redefined-builtin
    if tool not in TOOLS:
      raise ValueError(f"tool {tool!r}: must be one of {TOOLS}")
    if format not in FORMATS:
      raise ValueError(f"format {format!r}: must be one of {FORMATS}")
    if format == "chat" and tokenizer is None:
      raise ValueError("format=\"chat\" needs the decode server's tokenizer (its tool-call format)")
    self.format, self.tokenizer = format, tokenizer
    if not (call_open and call_close) or max_calls < 0:
      raise ValueError("a tool environment needs call markers and max_calls >= 0")
    self.tool, self.max_calls = tool, max_calls
    self.call_open, self.call_close = call_open, call_close
    self.result_open, self.result_close = result_open, result_close
    self.stop = (call_close,) if format == "markers" else tuple(tokenizer.tool_call_stop)
    self._latency = Latency.parse(latency)
    # latency draws: their own stream per episode (the decode server passes the episode's id), so
    # the members of a group, and the episodes of a run, wait independent times
    self._rng = np.random.default_rng([seed, zlib.crc32(episode_id.encode())])
    self._limits = python_limits or python_tool.Limits()
    self.allow_unsandboxed = allow_unsandboxed
    self._sandboxed: Optional[bool] = None
    # a control: every call is made as usual but answers this text instead of the tool's output
    # (``""``: the tool tells the policy nothing), so what the tool's answers buy can be measured
    self.constant_output = constant_output
    self.error_output = error_output  # the output a failed call shows the policy ("{error}": why)
    self.answer: Optional[str] = None
    self.calls = 0

  def reset(self, problem: dict) -> str:
    self.answer, self.calls = str(problem["answer"]), 0
    return problem["question"]

  def _run(self, text: str) -> tuple[str, str]:
    """(output, error) of the tool on ``text``."""
    if self.tool == "calculator":
      try:
        return calculator_workers().call(text), ""
      except (worker.ToolError, TimeoutError) as e:
        return self.error_output.format(error=e), str(e)
    r = python_tool.run_python(text, self._limits, self.allow_unsandboxed)
    self._sandboxed = r.sandboxed if self._sandboxed is None else self._sandboxed and r.sandboxed
    if r.timed_out:
      return self.error_output.format(error="timed out"), "timed out"
    if r.exit_code != 0:
      last = (r.stderr.strip().splitlines() or [f"exit code {r.exit_code}"])[-1]
      return self.error_output.format(error=last), last
    return r.stdout.strip(), ""

  def step(self, action: str) -> StepResult:
    if self.answer is None:
      raise RuntimeError("step before reset")
    self._sandboxed = None  # whether this turn's Python ran sandboxed (the turn's info records it)
    if self.format == "chat":
      return self._step_chat(str(action))
    start = action.rfind(self.call_open)
    if not action.endswith(self.call_close) or start < 0:
      return StepResult(reward=arithmetic.reward(action, self.answer), done=True, info={"ended": "answer"})
    if self.calls >= self.max_calls:
      return StepResult(done=True, info={"ended": "max_calls"})
    self.calls += 1
    output, error, waited = self._call(action[start + len(self.call_open):-len(self.call_close)])
    info = {"tool": self.tool, "latency": waited}
    if error:
      info["error"] = error
    if self._sandboxed is not None:
      info["sandboxed"] = self._sandboxed
    return StepResult(observation=f"{self.result_open}{output}{self.result_close}", info=info)

  def _call(self, text: str) -> tuple[str, str, float]:
    """(output, error, seconds waited) of one call: the drawn latency, the tool, the control."""
    waited = self._latency.draw(self._rng) if self._latency else 0.0
    if waited:
      time.sleep(waited)
    output, error = self._run(text)
    if self.constant_output is not None:
      output, error = self.constant_output, ""
    return output, error, waited

  def _step_chat(self, action: str) -> StepResult:
    """The tokenizer's chat format: tool calls as the endpoint parses them (Hermes ``<tool_call>``
    blocks, or the built-in ``[args]``), each answered by a ``tool`` message rendered by the chat
    template, as an agent program's would be: the same task trains through this environment and
    through an agent with the tool as a function."""
    content, calls = self.tokenizer.parse_tool_calls(action)
    if not calls:
      return StepResult(reward=arithmetic.reward(action, self.answer), done=True, info={"ended": "answer"})
    if self.calls + len(calls) > self.max_calls:
      return StepResult(done=True, info={"ended": "max_calls"})
    self.calls += len(calls)
    outputs, errors, waited = [], [], 0.0
    for call in calls:
      arguments = call["arguments"]
      if call["name"] not in (None, self.tool):
        output, error = self.error_output.format(error=f"no tool {call['name']!r}"), f"no tool {call['name']!r}"
      elif isinstance(arguments, dict) and not isinstance(arguments.get(ARGUMENT[self.tool]), str):
        error = f"the call needs a string argument {ARGUMENT[self.tool]!r}"
        output = self.error_output.format(error=error)
      else:
        text = arguments[ARGUMENT[self.tool]] if isinstance(arguments, dict) else str(arguments)
        output, error, seconds = self._call(text)
        waited += seconds
      outputs.append(output)
      if error:
        errors.append(error)
    message = {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{k}", "type": "function",
         "function": {"name": call["name"] or self.tool,
                      "arguments": json.dumps(call["arguments"] if isinstance(call["arguments"], dict)
                                              else {ARGUMENT[self.tool]: call["arguments"]})}}
        for k, call in enumerate(calls)]}
    answers = [{"role": "tool", "tool_call_id": f"call_{k}", "content": o} for k, o in enumerate(outputs)]
    info = {"tool": self.tool, "latency": waited}
    if errors:
      info["error"] = "; ".join(errors)
    if self._sandboxed is not None:
      info["sandboxed"] = self._sandboxed
    return StepResult(observation=self.tokenizer.encode_chat_continuation([message], answers), info=info)

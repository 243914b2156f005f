"""The coding agent's environment: write a program, run it on the public tests, read the failures,
try again; the hidden tests score the program submitted.

A problem is a code problem (``{"question", "answer"}``, the answer its tests in ``envs.code_tests``
form with the public ones first, their count in ``"public"``: ``data.code_functions``,
``data.code_problems``). Each action is the policy's text up to the end of a fenced python block (the
stop sequence: a newline and three backticks): the program, the block's last.

* The program runs on the public tests in the sandbox. If it passes them all, or if this was the
  ``max_attempts``-th attempt, it is submitted: the episode ends with the reward of all the tests
  (public and hidden, ``rl.rewards.code_reward``: 1 when every one passes).
* Otherwise the observation (context, never a policy action) shows what it got wrong:
  ``result_open`` + ``input:output`` of each failing public test (the program's output, its first
  line; ``?`` for an error, a timeout, or characters outside ``observation_chars``) joined by ``,``
  + ``result_close``, and the episode goes on.
* An action without a program ends the episode with reward 0 (``info["ended"]: "no program"``).

``format="chat"``: the same task through the decode server's tokenizer's chat format, as an agent
program would drive it through the OpenAI endpoint: a ``run_tests`` tool call (argument ``code``) is
answered by a ``tool`` message with the failures (or ``all public tests pass``); the episode ends
when the policy answers without a tool call, with the program in that answer scored on every test
(more than ``max_attempts`` calls end it with reward 0, ``info["ended"]: "max_calls"``).

Every run is sandboxed (the sandbox must run here: no unsandboxed mode); each turn's info says so.
"""

from __future__ import annotations

import json
from typing import Optional

from asyncrl_jax.envs import code_tests
from asyncrl_jax.envs.base import StepResult, register

FORMATS = ("markers", "chat")
BLOCK_END = "\n```"


@register("code")
class CodeEnvironment:
  """One episode of a coding problem (see the module's docstring)."""

  def __init__(self, max_attempts: int = 3, result_open: str = "{", result_close: str = "}",
               observation_chars: str = "0123456789-", seconds: float = 6.0, cpu_seconds: int = 4,
               format: str = "markers", tokenizer=None, episode_id: str = "", seed: int = 0):  # pylint: disable=redefined-builtin
    del episode_id, seed  # (nothing is drawn)
    if format not in FORMATS:
      raise ValueError(f"format {format!r}: must be one of {FORMATS}")
    if format == "chat" and tokenizer is None:
      raise ValueError("format=\"chat\" needs the decode server's tokenizer (its tool-call format)")
    if max_attempts < 1:
      raise ValueError(f"max_attempts={max_attempts}: must be >= 1")
    self.format, self.tokenizer = format, tokenizer
    self.max_attempts = max_attempts
    self.result_open, self.result_close = result_open, result_close
    self.observation_chars = set(observation_chars)
    self.limits = code_tests.CodeLimits(seconds=seconds, cpu_seconds=cpu_seconds)
    self.stop = (BLOCK_END,) if format == "markers" else tuple(tokenizer.tool_call_stop)
    self.tests: Optional[code_tests.CodeTests] = None
    self.public: Optional[code_tests.CodeTests] = None
    self.attempts = 0

  def reset(self, problem: dict) -> str:
    self.tests = code_tests.parse_tests(problem["answer"])
    n = self.tests.public
    if n < 1:
      raise ValueError("the coding agent's problems need public tests (tests' \"public\" >= 1)")
    self.public = code_tests.CodeTests(self.tests.mode, self.tests.inputs[:n], self.tests.expected[:n],
                                       self.tests.fn_name)
    self.attempts = 0
    return problem["question"]

  def _failures(self, program: str) -> tuple[list, bool]:
    """The failing public tests as ``(input, what it printed)``, and whether the run was sandboxed."""
    result = code_tests.run_tests(program, self.public, self.limits, partial=True)
    failed = []
    for i, (status, out) in enumerate(zip(result.statuses, result.outputs)):
      if status != "pass":
        got = out.strip().split("\n")[0] if status == "wrong" else "?"
        if not got or not set(got) <= self.observation_chars:
          got = "?"
        failed.append((str(self.public.inputs[i]).strip(), got[:12]))
    return failed, result.sandboxed

  def _submit(self, program: str, info: dict) -> StepResult:
    result = code_tests.run_tests(program, self.tests, self.limits)
    info.update(ended="submitted", attempts=self.attempts, passed=result.passed, sandboxed=result.sandboxed)
    return StepResult(reward=float(result.all_passed), done=True, info=info)

  def step(self, action: str) -> StepResult:
    if self.tests is None:
      raise RuntimeError("step before reset")
    if self.format == "chat":
      return self._step_chat(str(action))
    text = str(action)
    program = code_tests.extract_program(text if text.endswith("```") else text + "```")
    if program is None:
      return StepResult(done=True, info={"ended": "no program"})
    self.attempts += 1
    failed, sandboxed = self._failures(program)
    if not failed or self.attempts >= self.max_attempts:
      return self._submit(program, {"public_failed": len(failed)})
    shown = ",".join(f"{x}:{got}" for x, got in failed)
    return StepResult(observation=f"{self.result_open}{shown}{self.result_close}",
                      info={"public_failed": len(failed), "sandboxed": sandboxed})

  def _step_chat(self, action: str) -> StepResult:
    content, calls = self.tokenizer.parse_tool_calls(action)
    if not calls:  # the answer: its program is submitted
      program = code_tests.extract_program(content)
      if program is None:
        return StepResult(done=True, info={"ended": "no program"})
      return self._submit(program, {})
    if self.attempts + len(calls) > self.max_attempts:
      return StepResult(done=True, info={"ended": "max_calls", "attempts": self.attempts})
    self.attempts += len(calls)
    answers, message_calls = [], []
    sandboxed = True
    for k, call in enumerate(calls):
      arguments = call["arguments"]
      code = arguments.get("code") if isinstance(arguments, dict) else str(arguments)
      if call["name"] not in (None, "run_tests") or not isinstance(code, str):
        output = "error: call run_tests with a string argument code"
      else:
        failed, ran_sandboxed = self._failures(code_tests.extract_program(code) or code)
        sandboxed = sandboxed and ran_sandboxed
        output = ("all public tests pass" if not failed else
                  "failed: " + ", ".join(f"input {x!r} printed {got!r}" for x, got in failed))
      message_calls.append({"id": f"call_{k}", "type": "function", "function": {
          "name": call["name"] or "run_tests",
          "arguments": json.dumps(arguments if isinstance(arguments, dict) else {"code": arguments})}})
      answers.append({"role": "tool", "tool_call_id": f"call_{k}", "content": output})
    message = {"role": "assistant", "content": content, "tool_calls": message_calls}
    return StepResult(observation=self.tokenizer.encode_chat_continuation([message], answers),
                      info={"tool": "run_tests", "sandboxed": sandboxed})

"""The coding agent's environment: a program that fails the public tests gets its failures back and
another attempt; one that passes them is submitted and scored on the hidden tests too; the same task
through a chat format's run_tests tool calls."""

import json

import numpy as np
import pytest

from asyncrl_jax.data import code_functions
from asyncrl_jax.envs import base
from asyncrl_jax.tokenization import load_tokenizer


@pytest.fixture()
def problem():
  p = code_functions.make_problem(np.random.default_rng(3))
  return {"question": p.question, "answer": p.answer, "solution": p.solution}


def _program(body: str) -> str:
  return f"```python\nx=int(input())\nprint({body})\n```"


def _coefficients(problem):
  a, b = (int(s.split("=")[1]) for s in problem["solution"].split(";")[:2])
  return a, b


def test_failures_come_back_and_a_fixed_program_is_submitted(problem):
  a, b = _coefficients(problem)
  env = base.make("code")
  assert env.reset(problem) == problem["question"] and env.stop == ("\n```",)
  first = env.step(_program(f"{a}*x+{b + 1}"))  # off by one everywhere
  assert not first.done and first.info["public_failed"] == 3 and first.info["sandboxed"]
  assert first.observation == "{" + ",".join(f"{x}:{a * x + b + 1}" for x in code_functions.SHOWN) + "}"
  load_tokenizer("builtin:code_tools").encode(first.observation)  # (the agent's vocabulary spells it)
  done = env.step(_program(f"{a}*x+{b}" if b >= 0 else f"{a}*x-{-b}"))
  assert done.done and done.reward == 1.0 and done.info["ended"] == "submitted" and done.info["attempts"] == 2


def test_a_program_that_fits_the_examples_only_fails_on_submission(problem):
  """Passing the public tests submits; the hidden ones decide (the control against a memorised answer)."""
  shown = [int(v) for v in problem["question"].rstrip("?").replace(":", ",").split(",")[1::2]]
  lookup = "{" + ",".join(f"{x}:{v}" for x, v in zip(code_functions.SHOWN, shown)) + "}"
  env = base.make("code")
  env.reset(problem)
  out = env.step(f"```python\nprint({lookup}[int(input())])\n```")
  assert out.done and out.reward == 0.0 and out.info["public_failed"] == 0 and out.info["passed"] == 3


def test_the_last_attempt_is_submitted_and_no_program_ends_the_episode(problem):
  env = base.make("code", max_attempts=2)
  env.reset(problem)
  assert not env.step(_program("0")).done
  last = env.step(_program("0"))
  assert last.done and last.reward == 0.0 and last.info["attempts"] == 2
  env.reset(problem)
  none = env.step("no code here")
  assert none.done and none.reward == 0.0 and none.info == {"ended": "no program"}
  with pytest.raises(ValueError, match="need public tests"):
    env.reset({"question": "q", "answer": json.dumps({"stdin": [{"input": "1", "output": "1"}]})})


class _ChatTokenizer:
  """A chat format in miniature: ``CALL<code>`` is a run_tests call; messages render as role: text."""
  tool_call_stop = ("</call>",)

  def parse_tool_calls(self, text):
    if "<call>" not in text:
      return text, []
    content, code = text.split("<call>", 1)
    return content, [{"name": "run_tests", "arguments": {"code": code.removesuffix("</call>")}}]

  def encode_chat_continuation(self, history, new, tools=None):
    return [m["role"] + ": " + m["content"] for m in new]


def test_the_chat_format_answers_run_tests_calls_and_scores_the_answer(problem):
  a, b = _coefficients(problem)
  env = base.make("code", format="chat", tokenizer=_ChatTokenizer(), max_attempts=2)
  env.reset(problem)
  wrong = f"x=int(input())\nprint({a}*x+{b + 2})"
  out = env.step(f"let me test<call>{wrong}</call>")
  assert not out.done and out.info["tool"] == "run_tests"
  assert out.observation == ["tool: failed: " + ", ".join(
      f"input '{x}' printed '{a * x + b + 2}'" for x in code_functions.SHOWN)]
  right = f"x=int(input())\nprint({a}*x+({b}))"
  assert env.step(f"<call>{right}</call>").observation == ["tool: all public tests pass"]
  assert env.step(f"<call>{right}</call>").info["ended"] == "max_calls"  # (a third call: past max_attempts)
  env.reset(problem)
  final = env.step(f"done:\n```python\n{right}\n```")
  assert final.done and final.reward == 1.0

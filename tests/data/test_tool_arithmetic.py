"""The built-in tool task: problems, demonstrations a calculator episode reproduces, the tokenizer."""

import numpy as np
import pytest

from asyncrl_jax.data import tool_arithmetic
from asyncrl_jax.envs import base
from asyncrl_jax.tokenization import ArithmeticTokenizer, ToolTokenizer, load_tokenizer


def test_problems_and_solutions_agree_with_the_tool_environment():
  rng = np.random.default_rng(0)
  for _ in range(50):
    p = tool_arithmetic.make_problem(rng, 2, 5, 4)
    numbers = [int(x) for x in p.question[:-1].split("+")]
    assert 2 <= len(numbers) == p.num_terms <= 5 and all(0 <= x < 10 ** 4 for x in numbers)
    assert int(p.answer) == sum(numbers)
    # the demonstration is exactly what an episode with the calculator produces
    env = base.make("tools", **tool_arithmetic.ENV_OPTIONS)
    env.reset({"question": p.question, "answer": p.answer})
    call = p.solution[:p.solution.index("]") + 1]
    step = env.step(call)
    assert not step.done and step.info["tool"] == "calculator"
    final = p.solution[len(call) + len(step.observation):]
    assert call + step.observation + final == p.solution
    end = env.step(final)
    assert end.done and end.reward == 1.0
  with pytest.raises(ValueError, match="min_terms"):
    tool_arithmetic.make_problem(rng, 1, 3, 2)


def test_a_failed_call_shows_an_empty_result_the_vocabulary_can_encode():
  env = base.make("tools", **tool_arithmetic.ENV_OPTIONS)
  env.reset({"question": "1+2=", "answer": "3"})
  step = env.step("[1++]")
  assert step.observation == "{}" and step.info["error"]
  ToolTokenizer().encode(step.observation)


def test_the_tool_tokenizer_extends_the_arithmetic_one():
  tool, plain = load_tokenizer("builtin:tools"), load_tokenizer("")
  assert isinstance(tool, ToolTokenizer) and isinstance(plain, ArithmeticTokenizer)
  assert tool.vocab_size == 21 and plain.vocab_size == 17 and tool.identity != plain.identity
  text = "[12+3]{15}#15"
  assert tool.decode(tool.encode(text)) == text
  assert tool.encode("12+3=") == plain.encode("12+3=")  # the shared characters keep their ids
  with pytest.raises(ValueError, match="not in the built-in vocabulary"):
    plain.encode("[")

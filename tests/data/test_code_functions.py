"""The built-in code task: each worked solution passes its problem's hidden tests in the sandbox, the
hidden inputs are none of the shown ones, the built-in code vocabulary spells every solution, and the
cached reward runs a repeated program once."""

import json

import numpy as np
import pytest

from asyncrl_jax.data import code_functions
from asyncrl_jax.rl.rewards import CodeReward
from asyncrl_jax.tokenization import CodeTokenizer, TokenizerError, load_tokenizer


def test_worked_solutions_pass_their_hidden_tests_and_shortcuts_do_not():
  rng = np.random.default_rng(0)
  problems = [code_functions.make_problem(rng) for _ in range(200)]
  reward = CodeReward()
  for p in problems[:6]:
    assert reward(p.solution, p.answer) == 1.0
    shown = [int(v) for v in p.question.rstrip("?").replace(":", ",").split(",")[1::2]]
    # the controls: printing the first example's value, or a program for another function
    assert reward(f"```python\nprint({shown[0]})\n```", p.answer) == 0.0
    assert reward(p.solution.replace("*x", "*x+1"), p.answer) == 0.0
  for p in problems:
    all_tests = json.loads(p.answer)
    public, tests = all_tests["stdin"][:all_tests["public"]], all_tests["stdin"][all_tests["public"]:]
    assert [int(t["input"]) for t in public] == list(code_functions.SHOWN) and len(tests) == code_functions.TESTS
    assert not {int(t["input"]) for t in tests} & set(code_functions.SHOWN)  # hidden: none shown
    a, b = (int(s.split("=")[1]) for s in p.solution.split(";")[:2])
    assert all(int(t["output"]) == a * int(t["input"]) + b for t in public + tests)
  assert {p.solution.split(";")[1].split("=")[1][0] for p in problems} >= {"-", "0", "5"}  # b of each sign


def test_the_code_vocabulary_spells_every_solution_and_refuses_the_rest():
  tok = load_tokenizer("builtin:code")
  assert isinstance(tok, CodeTokenizer) and tok.vocab_size == 30
  rng = np.random.default_rng(1)
  for _ in range(100):
    p = code_functions.make_problem(rng)
    ids = tok.encode(p.solution)
    assert tok.decode(ids) == p.solution and len(ids) <= 40
    assert tok.decode(tok.encode_prompt(p.question)) == p.question and len(tok.encode_prompt(p.question)) <= 24
  # the pieces are single tokens
  assert len(tok.encode("```python\nx=int(input())\nprint(")) == 3
  with pytest.raises(TokenizerError, match="not in the built-in code vocabulary"):
    tok.encode("import os")


def test_the_cached_reward_runs_a_repeated_program_once():
  p = code_functions.make_problem(np.random.default_rng(2))
  reward = CodeReward()
  assert [reward(p.solution, p.answer) for _ in range(4)] == [1.0] * 4
  assert reward("prose, no program", p.answer) == 0.0
  assert reward.calls == 5 and reward.runs == 1  # (a completion without a program runs nothing)

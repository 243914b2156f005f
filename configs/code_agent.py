"""Built-in CPU experiment for a coding agent: write a program, run it on the public tests, read the
failures, try again; the hidden tests score the program submitted.

Run (one CPU machine, 4 virtual devices: 3 decode, 1 learner):

  python -m asyncrl_jax.train --config=configs/code_agent.py --workdir=/tmp/asyncrl_code_agent

The task is configs/code.py's (a program for ``a*x + b`` shown by ``f(1), f(2), f(3)``) as episodes
of the ``code`` environment (``envs.code_env``): each action ends with a fenced python block; the
environment runs it on the three shown examples (the public tests) in the sandbox; a program that
passes them, or the third attempt, is submitted and scored on all the tests (public and 4 hidden);
otherwise the observation lists the failing examples with what the program printed (``{2:9}``), and
the policy tries again. The objective is SAO's DIS with its coding interval: importance weights kept
strictly inside (0.2, 4.0) (``rl.eps_low=0.8``, ``rl.eps_high=3.0``). The vocabulary is the built-in
code vocabulary with ``{ }`` (``builtin:code_tools``, 32 tokens). Needs the sandbox.

``--config.env.options='{"format": "chat"}'`` with a Hugging Face tokenizer reads the policy's
``run_tests`` tool calls in its chat format instead, the tokens an agent program with the tool as an
OpenAI function produces through the chat endpoint (``envs.agent``).
"""

from asyncrl_jax.config import config_module

_code = config_module("code.py", beside=__file__)


def get_config():
  c = _code.get_config()
  c.model.update(vocab_size=32, max_seq_len=288)  # (evaluation: prompt + 2 x completion)
  c.data.update(tokenizer_path="builtin:code_tools", max_completion_len=128)
  c.env.update(name="code", max_turns=3)
  c.rollout.update(num_slots=48)
  c.rl.update(loss="dis", eps_low=0.8, eps_high=3.0)
  return c

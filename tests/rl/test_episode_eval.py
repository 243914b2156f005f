"""Held-out evaluation of episodes against a second implementation: greedy episodes decoded by the
decode server (cache kept across turns, observations appended with ``Engine.extend``) and by the
evaluator (each turn one XLA program over whole contexts) are the same tokens and the same rewards."""

import jax
import numpy as np
import pytest

from tests.fixtures.helpers import tool_calling_params
from asyncrl_jax import models
from asyncrl_jax.data import tool_arithmetic
from asyncrl_jax.infra import sharding
from asyncrl_jax.rl.episode_eval import EpisodeEvaluator
from asyncrl_jax.rollout import DecodeServer, Engine, RolloutRequest, SamplingSettings
from asyncrl_jax.tokenization import ToolTokenizer

TOK = ToolTokenizer()
CFG = models.ModelConfig(vocab_size=TOK.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_seq_len=112)
EPISODE = {"env": "tools", "options": dict(tool_arithmetic.ENV_OPTIONS), "max_turns": 3}


def test_greedy_episodes_match_the_decode_server():
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=-1, fsdp=1, tensor=1))
  params = tool_calling_params(CFG)
  rng = np.random.default_rng(0)
  problems = [tool_arithmetic.make_problem(rng, 2, 3, 2) for _ in range(8)]
  problems = [{"question": p.question, "answer": p.answer} for p in problems]
  evaluator = EpisodeEvaluator(CFG, mesh, TOK, problems, episode=EPISODE, max_prompt_len=16,
                               max_new_tokens=40, samples=0, sampling=None)
  rewards = evaluator._run(params, 1, SamplingSettings(temperature=0.0), None)  # pylint: disable=protected-access
  engine = Engine(CFG, mesh=mesh, num_slots=4, max_prefill_length=16, max_target_length=56,
                  sampling=SamplingSettings(temperature=0.0), params=params, tokenizer=TOK,
                  background_compile=False)
  server = DecodeServer(engine, params, steps_per_call=4)
  server.submit(*[RolloutRequest(prompt_tokens=TOK.encode_prompt(p["question"]), max_new_tokens=40,
                                 prompt_id=str(i), episode=dict(EPISODE, problem=p))
                  for i, p in enumerate(problems)])
  server.run_until_idle()
  by_id = {}
  while not server.finished.empty():
    t = server.finished.get()
    by_id[int(t.prompt_id)] = t
  called = rewarded = 0
  for i, (prompt, completion, reward, actions) in enumerate(evaluator.last_samples):
    t = by_id[i]
    assert completion.tolist() == t.completion_tokens.tolist(), (i, TOK.decode(completion),
                                                                  TOK.decode(t.completion_tokens))
    assert actions.tolist() == t.actions.astype(float).tolist()  # observations: 0, as the server's
    assert reward == pytest.approx(t.episode_reward) == rewards[i]
    called += len(t.turns) > 1
    rewarded += reward > 0
  assert called >= 2, "too few episodes called the tool for the comparison to mean anything"
  print(f"{called} of {len(problems)} episodes called the calculator, {rewarded} answered right")
  assert evaluator.last_tools["tool_calls_per_episode"] > 0


def test_an_environment_whose_stop_is_not_one_token_is_refused():
  mesh = sharding.make_mesh(jax.devices()[:1], dict(data=-1, fsdp=1, tensor=1))
  episode = dict(EPISODE, options=dict(EPISODE["options"], call_close="]]"))
  with pytest.raises(ValueError, match="at most one stop sequence, of one token"):
    EpisodeEvaluator(CFG, mesh, TOK, [{"question": "1+1=", "answer": "2"}], episode=episode,
                     max_prompt_len=16, max_new_tokens=40)
  with pytest.raises(ValueError, match="model.max_seq_len=112 must be >= 136"):
    EpisodeEvaluator(CFG, mesh, TOK, [{"question": "1+1=", "answer": "2"}], episode=EPISODE,
                     max_prompt_len=16, max_new_tokens=60)

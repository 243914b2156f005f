"""Agent programs written against the official ``openai`` client are trained as they are: their
requests become the turns of one episode on the decode server, answered by the policy's actions,
with what they add to the conversation recorded as observations."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import openai
import pytest

from tests.fixtures import agent_program
from tests.fixtures.helpers import tool_calling_params
from asyncrl_jax import models
from asyncrl_jax.data import tool_arithmetic
from asyncrl_jax.envs import chat_endpoint
from asyncrl_jax.infra import sharding
from asyncrl_jax.rollout import DecodeServer, Engine, RolloutRequest, SamplingSettings
from asyncrl_jax.tokenization import ToolTokenizer

TOK = ToolTokenizer()
CFG = models.ModelConfig(vocab_size=TOK.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_seq_len=96)
EPISODE = {"env": "openai-agent", "options": {"program": "tests.fixtures.agent_program:solve"}, "max_turns": 4}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def params():
  return tool_calling_params(CFG)


def _run_episodes(params, program, n=6, seed=5, max_new=50):
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(CFG, mesh=mesh, num_slots=4, max_prefill_length=16, max_target_length=72,
                  sampling=SamplingSettings(temperature=1.0), params=params, tokenizer=TOK, seed=1,
                  background_compile=False)
  server = DecodeServer(engine, params, steps_per_call=4, env_timeout=30)
  rng = np.random.default_rng(seed)
  problems = [tool_arithmetic.make_problem(rng, 2, 3, 2) for _ in range(n)]
  assert len({p.question for p in problems}) == n
  agent_program.CALLS.clear()
  agent_program.TRANSCRIPTS.clear()
  episode = dict(EPISODE, options={"program": program})
  server.submit(*[RolloutRequest(prompt_tokens=TOK.encode_prompt(p.question), max_new_tokens=max_new,
                                 prompt_id=str(i), episode=dict(episode, problem={
                                     "question": p.question, "answer": p.answer}))
                  for i, p in enumerate(problems)])
  server.run_until_idle()
  got = []
  while not server.finished.empty():
    got.append(server.finished.get())
  server.stop()
  assert len(got) == n
  return problems, got


def test_an_openai_client_calls_a_function_tool_and_the_mask_covers_exactly_the_models_tokens(params):
  """The official client with ``tools=[calculator]``: the policy's calls come back as ``tool_calls``;
  each turn's action is exactly the text the client was answered (its content, then the call in the
  built-in form ``[expression]``), each observation exactly the tool result the client sent
  (``{result}``), and the action mask is 1 on the actions and 0 on the observations."""
  problems, got = _run_episodes(params, "tests.fixtures.agent_program:solve")
  finished = {t.finish_reason for t in got}
  assert finished <= {"eos", "env_done", "length", "turns"}, [(t.finish_reason, t.error) for t in got]
  called = 0
  for t in got:
    problem = problems[int(t.prompt_id)]
    assert t.prompt_tokens.tolist() == TOK.encode_prompt(problem.question)  # the first request's rendering
    transcript = agent_program.TRANSCRIPTS.get(problem.question)
    if t.finish_reason not in ("eos", "env_done"):
      continue  # (cut by the budget or the turn limit: the program's transcript is unfinished)
    assert transcript is not None and len(transcript) == len(t.turns), (transcript, t.turns)
    expected_mask = []
    for turn, (message, results) in zip(t.turns, transcript):
      (a0, a1), (o0, o1) = turn.action, turn.observation
      calls = "".join(f"[{json.loads(c['function']['arguments'])['expression']}]"
                      for c in message.get("tool_calls", []))
      text = TOK.decode(t.completion_tokens[a0:a1])
      if not calls:  # (an answer's content leaves out the stop sequence it ended at, as OpenAI's does)
        text = text.removesuffix("]")
      assert text == (message.get("content") or "") + calls
      assert TOK.decode(t.completion_tokens[o0:o1]) == "".join("{" + r + "}" for r in results)
      expected_mask += [1] * (a1 - a0) + [0] * (o1 - o0)
      called += bool(calls)
    if t.completion_tokens[-1] == TOK.eos_id:  # the final action's end of sequence (not text)
      assert len(expected_mask) == len(t.completion_tokens)
    assert t.action_mask.tolist() == expected_mask
    final = transcript[-1][0]
    want = float(final["content"].rsplit("#", 1)[-1] == problem.answer) if "#" in final["content"] else 0.0
    assert t.episode_reward == want
  assert called >= 3, "too few tool calls for the test to mean anything"
  # every episode that ended naturally was one program run of as many requests as actions
  by_requests = sorted(n for _, n in agent_program.CALLS)
  assert by_requests == sorted(len(t.turns) for t in got if t.finish_reason in ("eos", "env_done"))


def test_an_agents_sdk_agent_trains_through_the_endpoint(params):
  """An agent of the OpenAI Agents SDK (``openai-agents``, chat completions model) with a
  ``function_tool``: its tool calls and results become the episode's turns."""
  pytest.importorskip("agents")
  problems, got = _run_episodes(params, "tests.fixtures.agent_program:solve_with_agents_sdk")
  assert {t.finish_reason for t in got} <= {"eos", "env_done", "length", "turns"}, \
      [(t.finish_reason, t.error) for t in got]
  natural = [t for t in got if t.finish_reason in ("eos", "env_done")]
  assert natural, [(t.finish_reason, t.error) for t in got]
  tool_turns = [turn for t in got for turn in t.turns if turn.observation[1] > turn.observation[0]]
  assert tool_turns, "no tool call went through the SDK: the test checks nothing"
  for t in got:
    for turn in t.turns:
      o0, o1 = turn.observation
      observed = TOK.decode(t.completion_tokens[o0:o1])
      assert not t.actions[o0:o1].any() and (o1 == o0 or (observed.startswith("{") and observed.endswith("}")))


def test_an_episode_that_ends_answers_its_waiting_request_409_and_releases_its_id(params):
  """The token budget ends an episode in its first action while the program's request waits for it:
  the request is answered 409 (the episode ended), and a request after that finds no episode (404:
  its id was released)."""
  agent_program.REFUSALS.clear()
  _, got = _run_episodes(params, "tests.fixtures.agent_program:solve_until_refused", n=6, max_new=2)
  # (an answer of at most 2 tokens, ended by the stop sequence or by EOS, ends its episode by the
  # program returning: no refusal there; which requests draw such answers depends on their sampling
  # keys, i.e. on the request ids the server has handed out before)
  assert {t.finish_reason for t in got} <= {"length", "env_done", "eos"}, [(t.finish_reason, t.error) for t in got]
  cut = [t for t in got if t.finish_reason == "length"]
  assert cut, "no episode was cut while its request waited: the test checks nothing"
  deadline = time.time() + 10  # (the programs go on on their own threads after their episodes)
  while len(agent_program.REFUSALS) < len(cut) and time.time() < deadline:
    time.sleep(0.05)
  assert agent_program.REFUSALS == [(409, 404)] * len(cut)


def test_a_conversation_the_template_cannot_continue_is_answered_400_at_once():
  """The episode cannot encode the program's next request as a continuation of its context (here the
  tokenizer refuses, as a reasoning template does after a new user turn): the request is answered
  400 with the reason at once, not left to time out (504)."""
  from asyncrl_jax.envs.agent import AgentEnvironment  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tokenization import TokenizerError  # pylint: disable=import-outside-toplevel

  class Refusing(ToolTokenizer):
    def encode_chat_continuation(self, history, new, tools=None):
      if history:  # (the first request's rendering goes through here too)
        raise TokenizerError("the template says no")
      return super().encode_chat_continuation(history, new, tools)

  agent_program.FOLLOW_UPS.clear()
  env = AgentEnvironment("tests.fixtures.agent_program:solve_then_follow_up", tokenizer=Refusing(),
                         step_timeout=30)
  try:
    assert env.reset({"question": "1+2=", "answer": "3"}) == TOK.encode_prompt("1+2=")
    with pytest.raises(chat_endpoint.RequestError, match="the template says no"):
      env.step("#3")
    deadline = time.time() + 30
    while not agent_program.FOLLOW_UPS and time.time() < deadline:
      time.sleep(0.05)
  finally:
    env.close()
  ((status, seconds, message),) = agent_program.FOLLOW_UPS
  assert status == 400 and "the template says no" in message and seconds < 10


def test_max_tokens_caps_the_action(params):
  """A request's ``max_tokens`` ends the policy's action at that many tokens: finish reason
  ``length``, ``usage.completion_tokens`` the action's length, the turn recorded as ``max_tokens``."""
  agent_program.CAPPED.clear()
  _, got = _run_episodes(params, "tests.fixtures.agent_program:solve_capped", n=4)
  assert len(agent_program.CAPPED) == 4
  for t in got:
    assert t.turns[0].action[1] - t.turns[0].action[0] <= 2
  cut = [t for t in got if t.turns[0].ended == "max_tokens"]
  assert cut, "no action reached the cap: the test checks nothing"
  assert sum(finish == "length" for finish, _, _ in agent_program.CAPPED) == len(cut)
  assert all(n == 2 for finish, n, _ in agent_program.CAPPED if finish == "length")
  for t in cut:
    assert t.turns[0].action == (0, 2)


def test_requests_outside_an_episode_or_malformed_are_refused():
  endpoint = chat_endpoint.shared()
  client = openai.OpenAI(base_url=endpoint.base_url, api_key="x", max_retries=0,
                         default_headers={chat_endpoint.EPISODE_HEADER: "no-such-episode"})
  with pytest.raises(openai.NotFoundError, match="no episode 'no-such-episode'"):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1+1="}])
  endpoint.register("e1", lambda chat: pytest.fail("not reached"))
  client = openai.OpenAI(base_url=endpoint.base_url, api_key="x", max_retries=0,
                         default_headers={chat_endpoint.EPISODE_HEADER: "e1"})
  with pytest.raises(openai.BadRequestError, match="n must be 1"):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1"}], n=2)
  with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
    client.chat.completions.create(model="policy", messages=[])
  endpoint.unregister("e1")
  assert [m.id for m in client.models.list()] == ["policy"]
  # a token-protected endpoint refuses a wrong key (the same secret as the other servers)
  guarded = chat_endpoint.ChatEndpoint("127.0.0.1", 0, token="s" * 32)
  request = urllib.request.Request(guarded.base_url + "/models", headers={"Authorization": "Bearer wrong"})
  with pytest.raises(urllib.error.HTTPError, match="401"):
    urllib.request.urlopen(request, timeout=10)
  ok = urllib.request.Request(guarded.base_url + "/models", headers={"Authorization": "Bearer " + "s" * 32})
  assert json.load(urllib.request.urlopen(ok, timeout=10))["data"][0]["id"] == "policy"
  guarded.close()
  with pytest.raises(Exception, match="not a loopback address"):
    chat_endpoint.ChatEndpoint("0.0.0.0", 0, token=None)


@pytest.mark.slow(60)
def test_the_main_job_trains_an_openai_client_agent(tmp_path):
  """A few policy versions of configs/tool_use.py with the agent program as the environment."""
  options = json.dumps({"program": "tests.fixtures.agent_program:solve"})
  cmd = [sys.executable, "-m", "asyncrl_jax.train", f"--config={ROOT}/configs/tool_use.py",
         f"--workdir={tmp_path}", "--config.steps=3", "--config.env.name=openai-agent",
         f"--config.env.options={options}", "--config.learner.warm_start_steps=20",
         "--config.learner.warm_start_lr=3e-3", "--config.data.num_train=300", "--config.data.num_test=20",
         "--config.data.eval_problems=8", "--config.data.eval_samples=2", "--config.learner.batch_size=16",
         "--config.rl.group_size=4", "--config.rollout.num_slots=12", "--config.learner.eval_every=3",
         "--config.learner.token_budget=2048", "--config.learner.warm_up=False",
         "--config.rollout.warm_up=False", "--config.log.trajectories=2"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["episodes"] == 3 * 16 and summary["steps"] == 3
  metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [m["version"] for m in metrics] == [1, 2, 3]
  dumped = [json.loads(l) for l in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
  assert all(d["turns"] for d in dumped)
  # the warm-started model calls the calculator: some episodes went back to the model with a tool
  # message (a run where no episode did would not test the agent loop at all)
  assert summary["turns_per_episode"] > 1.0, summary

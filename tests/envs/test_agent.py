"""Agent programs written against the official ``openai`` client are trained as they are: their
requests become the turns of one episode on the decode server, answered by the policy's actions,
with what they add to the conversation recorded as observations."""

import json
import os
import subprocess
import sys
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
EPISODE = {"env": "openai-agent", "options": {"program": "tests.fixtures.agent_program:solve",
                                              "stop": ["]"]}, "max_turns": 4}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def params():
  return tool_calling_params(CFG)


def test_an_openai_client_program_drives_episodes_on_the_decode_server(params):
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=-1, fsdp=1, tensor=1))
  engine = Engine(CFG, mesh=mesh, num_slots=4, max_prefill_length=16, max_target_length=72,
                  sampling=SamplingSettings(temperature=1.0), params=params, tokenizer=TOK, seed=1,
                  background_compile=False)
  server = DecodeServer(engine, params, steps_per_call=4, env_timeout=30)
  rng = np.random.default_rng(5)
  problems = [tool_arithmetic.make_problem(rng, 2, 3, 2) for _ in range(6)]
  agent_program.CALLS.clear()
  server.submit(*[RolloutRequest(prompt_tokens=TOK.encode_prompt(p.question), max_new_tokens=50,
                                 prompt_id=str(i), episode=dict(EPISODE, problem={
                                     "question": p.question, "answer": p.answer}))
                  for i, p in enumerate(problems)])
  server.run_until_idle()
  got = []
  while not server.finished.empty():
    got.append(server.finished.get())
  assert len(got) == 6
  finished = {t.finish_reason for t in got}
  assert finished <= {"eos", "env_done", "length", "turns"}, [(t.finish_reason, t.error) for t in got]
  called = 0
  for t in got:
    text = TOK.decode(t.completion_tokens)
    for k, turn in enumerate(t.turns):
      a0, a1 = turn["action"]
      o0, o1 = turn["observation"]
      if o1 > o0:  # a tool result the program sent: context, exactly its message
        called += 1
        obs = TOK.decode(t.completion_tokens[o0:o1])
        assert obs.startswith("{") and obs.endswith("}") and not t.actions[o0:o1].any()
        # the call's action ended at the stop sequence or at the end of sequence
        assert TOK.decode(t.completion_tokens[a1 - 1:a1]) == "]" or t.completion_tokens[a1 - 1] == TOK.eos_id
    if t.finish_reason in ("eos", "env_done"):  # the program returned: its reward is the episode's
      answer = problems[int(t.prompt_id)].answer
      final = TOK.decode(t.completion_tokens[slice(*t.turns[-1]["action"])]).removesuffix("]")
      scored = "#" in final and not final.startswith("[")  # (a call as the 4th request: no answer)
      want = float(final.rsplit("#", 1)[-1] == answer) if scored else 0.0
      assert t.episode_reward == want, (text, answer)
  assert called >= 3, "too few tool calls for the test to mean anything"
  # every episode that ended naturally was one program run of as many requests as actions
  by_requests = sorted(n for _, n in agent_program.CALLS)
  assert by_requests == sorted(len(t.turns) for t in got if t.finish_reason in ("eos", "env_done"))
  server.stop()


def test_requests_outside_an_episode_or_malformed_are_refused():
  endpoint = chat_endpoint.shared()
  client = openai.OpenAI(base_url=endpoint.base_url, api_key="x", max_retries=0,
                         default_headers={chat_endpoint.EPISODE_HEADER: "no-such-episode"})
  with pytest.raises(openai.NotFoundError, match="no episode 'no-such-episode'"):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1+1="}])
  endpoint.register("e1", lambda messages, stop: pytest.fail("not reached"))
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
  options = json.dumps({"program": "tests.fixtures.agent_program:solve", "stop": ["]"]})
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

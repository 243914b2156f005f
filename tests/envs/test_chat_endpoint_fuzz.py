"""The chat endpoint against malformed requests: every bad field answers 400 naming it, nothing
answers 500, and a request whose answer never comes is answered within the endpoint's timeout."""

import json
import urllib.error
import urllib.request
from concurrent import futures

import numpy as np

from asyncrl_jax.envs import chat_endpoint

VALUES = [None, True, False, 0, 1, 2, -1, 1.5, "", "abc", [], [1], ["x"], {}, {"a": 1},
          [{"type": "text", "text": "hi"}], [{"type": "image_url", "image_url": {"url": "x"}}],
          "x" * 1000, 10 ** 30, float("1e308")]
FIELDS = ["model", "stream", "n", "stop", "temperature", "top_p", "max_tokens", "seed", "messages",
          "presence_penalty", "logprobs", "tools", "user", "tool_choice", "parallel_tool_calls",
          "max_completion_tokens", "response_format", "logit_bias"]
GOOD = {"model": "policy", "messages": [{"role": "user", "content": "1+1="}]}


def _post(url, body, episode="e1"):
  data = body if isinstance(body, bytes) else json.dumps(body).encode()
  req = urllib.request.Request(url + "/chat/completions", data=data, method="POST",
                               headers={"Content-Type": "application/json", chat_endpoint.EPISODE_HEADER: episode})
  try:
    with urllib.request.urlopen(req, timeout=30) as r:
      return r.status, json.load(r)
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read() or b"{}")


def test_malformed_requests_answer_400_naming_the_field_and_never_500():
  endpoint = chat_endpoint.ChatEndpoint("127.0.0.1", 0, token=None, answer_timeout=5)

  def handler(chat):
    assert isinstance(chat, chat_endpoint.ChatRequest)
    done = futures.Future()
    done.set_result(chat_endpoint.ChatReply(content="#2", prompt_tokens=3, completion_tokens=2))
    return done

  endpoint.register("e1", handler)
  try:
    assert _post(endpoint.base_url, GOOD)[0] == 200
    rng = np.random.default_rng(0)
    seen = set()
    for field in FIELDS:  # each field with every value, the rest good
      for value in VALUES:
        status, body = _post(endpoint.base_url, dict(GOOD, **{field: value}))
        assert status in (200, 400), (field, value, status, body)
        if status == 400:
          seen.add(field)
          assert field in body["error"]["message"] or field == "messages", (field, value, body)
    for _ in range(200):  # random mixtures, and messages of random shapes
      body = {f: VALUES[rng.integers(len(VALUES))] for f in rng.choice(FIELDS, rng.integers(1, 5))}
      if rng.random() < 0.5:
        body["messages"] = [{"role": VALUES[rng.integers(len(VALUES))], "content": VALUES[rng.integers(len(VALUES))]}]
      assert _post(endpoint.base_url, body)[0] in (200, 400), body
    for raw in (b"", b"{", b"[1, 2]", b"null", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000):
      assert _post(endpoint.base_url, raw)[0] == 400, raw[:20]  # (the last: nested past the parser)
    for refused, named in ((dict(logprobs=True), "logprobs"), (dict(top_logprobs=2), "logprobs"),
                           (dict(parallel_tool_calls=False), "parallel_tool_calls")):
      status, body = _post(endpoint.base_url, dict(GOOD, **refused))
      assert status == 400 and named in body["error"]["message"], (refused, body)
    assert _post(endpoint.base_url, dict(GOOD, logprobs=False, parallel_tool_calls=True))[0] == 200
    assert {"n", "stream", "messages", "temperature", "stop", "tools", "tool_choice", "max_tokens"} <= seen
    status, body = _post(endpoint.base_url, dict(GOOD, messages=[
        {"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "1="}]}]))
    assert status == 200  # OpenAI content parts are read as their text
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    # a tool-calling conversation: tools, an assistant message with tool_calls (no content), a tool
    # message; bad tool fields are named
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "1+1"}'}}
    tool = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
    conversation = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    assert _post(endpoint.base_url, dict(GOOD, messages=conversation, tools=[tool], tool_choice="auto"))[0] == 200
    for bad, named in [(dict(tools=[{"type": "function"}]), "tools[0]"),
                       (dict(tool_choice="required"), "tool_choice"),
                       (dict(tool_choice={"type": "function", "function": {"name": "calc"}}), "tool_choice"),
                       (dict(messages=[conversation[0], dict(conversation[1], tool_calls=[{"id": 1}])]),
                        "messages[1].tool_calls[0]"),
                       (dict(messages=[dict(conversation[2], tool_call_id=3)]), "messages[0].tool_call_id"),
                       (dict(max_tokens=0), "max_tokens"),
                       (dict(response_format={"type": "json_object"}), "response_format"),
                       (dict(messages=[{"role": "robot", "content": "x"}]), "messages[0]")]:
      status, body = _post(endpoint.base_url, dict(GOOD, **bad))
      assert status == 400 and named in body["error"]["message"], (bad, body)
  finally:
    endpoint.close()


def test_a_request_without_an_answer_is_answered_at_the_timeout():
  endpoint = chat_endpoint.ChatEndpoint("127.0.0.1", 0, token=None, answer_timeout=0.5)
  endpoint.register("e1", lambda chat: futures.Future())  # never answered
  try:
    status, body = _post(endpoint.base_url, GOOD)
    assert status == 504 and "no answer within 0.5s" in body["error"]["message"]
  finally:
    endpoint.close()


def test_an_episode_sets_how_long_its_requests_wait():
  endpoint = chat_endpoint.ChatEndpoint("127.0.0.1", 0, token=None, answer_timeout=60)
  endpoint.register("e1", lambda chat: futures.Future(), answer_timeout=0.3)  # (its step timeout)
  try:
    status, body = _post(endpoint.base_url, GOOD)
    assert status == 504 and "no answer within 0.3s" in body["error"]["message"]
  finally:
    endpoint.close()

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
          "presence_penalty", "logprobs", "tools", "user"]
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

  def handler(messages, stop):
    done = futures.Future()
    done.set_result(("#2", "stop"))
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
    for raw in (b"", b"{", b"[1, 2]", b"null", b"\xff\xfe"):
      assert _post(endpoint.base_url, raw)[0] == 400, raw
    assert {"n", "stream", "messages", "temperature", "stop"} <= seen
    status, body = _post(endpoint.base_url, dict(GOOD, messages=[
        {"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "1="}]}]))
    assert status == 200  # OpenAI content parts are read as their text
  finally:
    endpoint.close()


def test_a_request_without_an_answer_is_answered_at_the_timeout():
  endpoint = chat_endpoint.ChatEndpoint("127.0.0.1", 0, token=None, answer_timeout=0.5)
  endpoint.register("e1", lambda messages, stop: futures.Future())  # never answered
  try:
    status, body = _post(endpoint.base_url, GOOD)
    assert status == 504 and "no answer within 0.5s" in body["error"]["message"]
  finally:
    endpoint.close()

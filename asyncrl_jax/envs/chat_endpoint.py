"""An OpenAI-compatible chat endpoint for agent programs we did not write: ``POST
/v1/chat/completions`` (non-streaming, one choice) and ``GET /v1/models``.

Each request belongs to an episode in progress, named by the ``X-Episode-Id`` header (the agent
environment gives its program a client configured with it); the episode's environment
(``envs.agent``) answers it with the policy's next action, decoded by the decode server that holds the
episode's slot. One endpoint serves every episode of its process; it binds 127.0.0.1 on a free port
unless told otherwise, and a host beyond loopback needs the run's shared secret
(``ASYNCRL_AUTH_TOKEN``), which every request must then send as its API key (``Authorization: Bearer``).

What the endpoint does not do: stream, sample several choices, or change the sampling settings (the
decode servers' are the behaviour policy the learner corrects for; a request's ``temperature``,
``top_p`` and the like are ignored), or serve requests outside an episode.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from concurrent import futures
from typing import Callable, Optional

from aiohttp import web

from asyncrl_jax.infra import auth

EPISODE_HEADER = "X-Episode-Id"
MODEL_NAME = "policy"


class RequestError(ValueError):
  """A request the episode cannot answer (the message goes back with HTTP 400)."""


def _error(status: int, message: str) -> web.Response:
  return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=status)


class ChatEndpoint:
  """The HTTP server, on its own thread and event loop. ``register(episode_id, handler)``: requests
  of that episode go to ``handler(messages, stop) -> Future[(content, finish_reason)]`` (it may raise
  ``RequestError``)."""

  def __init__(self, host: str = "127.0.0.1", port: int = 0, token: Optional[str] = None,
               answer_timeout: float = 600.0):
    auth.require(host, token, "the agent environment's host")
    self.host, self._token = host, token
    self.answer_timeout = answer_timeout  # the longest a request waits for the policy's answer
    self._handlers: dict[str, Callable] = {}
    self._lock = threading.Lock()
    self._loop = asyncio.new_event_loop()
    started: futures.Future = futures.Future()
    self._thread = threading.Thread(target=self._serve, args=(host, port, started), daemon=True,
                                    name="chat-endpoint")
    self._thread.start()
    self.port = started.result(timeout=30)
    self.base_url = f"http://{host}:{self.port}/v1"

  def _serve(self, host: str, port: int, started: futures.Future) -> None:
    asyncio.set_event_loop(self._loop)
    app = web.Application(client_max_size=8 << 20)
    app.router.add_post("/v1/chat/completions", self._chat)
    app.router.add_get("/v1/models", self._models)
    runner = web.AppRunner(app, access_log=None)
    try:
      self._loop.run_until_complete(runner.setup())
      site = web.TCPSite(runner, host, port)
      self._loop.run_until_complete(site.start())
      started.set_result(site._server.sockets[0].getsockname()[1])  # pylint: disable=protected-access
    except Exception as e:  # pylint: disable=broad-except
      started.set_exception(e)
      return
    self._loop.run_forever()

  def register(self, episode_id: str, handler: Callable) -> None:
    with self._lock:
      self._handlers[episode_id] = handler

  def unregister(self, episode_id: str) -> None:
    with self._lock:
      self._handlers.pop(episode_id, None)

  def _authorized(self, request) -> bool:
    if self._token is None:
      return True
    sent = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    return hmac.compare_digest(sent.encode(), self._token.encode())

  async def _models(self, request) -> web.Response:
    if not self._authorized(request):
      return _error(401, "missing or wrong API key (the run's ASYNCRL_AUTH_TOKEN)")
    return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                                                          "owned_by": "asyncrl_jax"}]})

  async def _chat(self, request) -> web.Response:
    if not self._authorized(request):
      return _error(401, "missing or wrong API key (the run's ASYNCRL_AUTH_TOKEN)")
    try:
      body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
      return _error(400, "the request body is not JSON")
    episode_id = request.headers.get(EPISODE_HEADER, "")
    with self._lock:
      handler = self._handlers.get(episode_id)
    if handler is None:
      return _error(404, f"no episode {episode_id!r} in progress on this endpoint (header {EPISODE_HEADER})")
    try:
      messages, stop = _parse(body)
      answer = handler(messages, stop)
    except RequestError as e:
      return _error(400, str(e))
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # bad input never answers 500
      return _error(400, f"malformed request: {type(e).__name__}: {e}"[:300])
    try:
      content, finish_reason = await asyncio.wait_for(asyncio.wrap_future(answer), self.answer_timeout)
    except asyncio.TimeoutError:
      return _error(504, f"episode {episode_id}: no answer within {self.answer_timeout:g}s")
    except RequestError as e:
      return _error(400, str(e))
    except Exception as e:  # pylint: disable=broad-except  (the episode ended without an answer)
      return _error(409, f"episode {episode_id}: {e}")
    return web.json_response({
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": str(body.get("model") or MODEL_NAME),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}})

  def close(self) -> None:
    self._loop.call_soon_threadsafe(self._loop.stop)


# request fields an agent framework sends, with the type each must have; fields that would change
# the behaviour policy the learner records are accepted only at their neutral values (below)
_TYPES = {"model": str, "stream": bool, "n": int, "stop": (str, list, type(None)),
          "temperature": (int, float), "top_p": (int, float), "max_tokens": (int, type(None)),
          "max_completion_tokens": (int, type(None)), "seed": (int, type(None)), "user": str,
          "presence_penalty": (int, float), "frequency_penalty": (int, float),
          "logprobs": (bool, type(None)), "top_logprobs": (int, type(None))}


def _content(i: int, content) -> str:
  """A message's text: a string, or OpenAI's list of content parts of type "text"."""
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    texts = []
    for j, part in enumerate(content):
      if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise RequestError(f"messages[{i}].content[{j}]: only parts of type \"text\" with a string text "
                           "are supported")
      texts.append(part["text"])
    return "".join(texts)
  raise RequestError(f"messages[{i}].content must be a string or a list of text parts")


def _parse(body) -> tuple[list, Optional[tuple]]:
  """The request's messages and stop sequences; a ``RequestError`` naming the first bad field."""
  if not isinstance(body, dict):
    raise RequestError("the request body must be a JSON object")
  for field, kind in _TYPES.items():
    if field in body and (not isinstance(body[field], kind)
                          or (isinstance(body[field], bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)))):
      raise RequestError(f"{field}={body[field]!r}: wrong type")
  if body.get("stream"):
    raise RequestError("stream: streaming is not supported (stream must be false)")
  if body.get("n", 1) != 1:
    raise RequestError("n must be 1 (an episode is one trajectory)")
  for field, neutral in (("presence_penalty", 0), ("frequency_penalty", 0)):
    if body.get(field, neutral) != neutral:
      raise RequestError(f"{field} must be {neutral}: it would change the sampling policy the learner "
                         "records (the run's rollout settings decide it)")
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise RequestError("messages must be a non-empty list")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise RequestError(f"messages[{i}] needs a string role")
    if "content" not in m:
      raise RequestError(f"messages[{i}].content is missing")
    out.append({"role": m["role"], "content": _content(i, m["content"])})
  stop = body.get("stop")
  if isinstance(stop, str):
    stop = (stop,)
  elif stop is not None:
    if not all(isinstance(s, str) for s in stop):
      raise RequestError("stop must be a string or a list of strings")
    stop = tuple(stop)
  return out, stop


_SHARED: dict = {}
_SHARED_LOCK = threading.Lock()


def shared(host: str = "127.0.0.1", port: int = 0, token: Optional[str] = None) -> ChatEndpoint:
  """This process's endpoint on ``host`` (started at the first call; later calls get the same one,
  and must not ask for another port)."""
  with _SHARED_LOCK:
    endpoint = _SHARED.get(host)
    if endpoint is None:
      endpoint = _SHARED[host] = ChatEndpoint(host, port, token)
    elif port and port != endpoint.port:
      raise ValueError(f"the chat endpoint of this process listens on {host}:{endpoint.port}, not {port}")
    return endpoint

"""An OpenAI-compatible chat endpoint for agent programs we did not write: ``POST
/v1/chat/completions`` (non-streaming, one choice) and ``GET /v1/models``.

Each request belongs to an episode in progress, named by the ``X-Episode-Id`` header (the agent
environment gives its program a client configured with it); the episode's environment
(``envs.agent``) answers it with the policy's next action, decoded by the decode server that holds the
episode's slot. One endpoint serves every episode of its process; it binds 127.0.0.1 on a free port
unless told otherwise, and a host beyond loopback needs the run's shared secret
(``ASYNCRL_AUTH_TOKEN``), which every request must then send as its API key (``Authorization: Bearer``).

Standard tool calling: ``tools`` (function schemas) in the request, ``tool_calls`` in the answer
(parsed from the policy's text by the tokenizer's format: Qwen2.5 / Hermes ``<tool_call>`` blocks, or
the built-in vocabulary's ``[args]``), assistant messages with ``tool_calls`` and ``role: "tool"``
messages in the conversation. ``max_tokens`` / ``max_completion_tokens`` cap the answer (finish reason
``length``); ``usage`` counts the context and the answer in tokens.

What the endpoint refuses, by name (400): streaming, ``n`` other than 1, and every setting that would
change the sampling policy the learner records: ``temperature`` and ``top_p`` other than the run's,
penalties other than 0, ``tool_choice`` other than ``auto`` (forcing or forbidding a call), a
``response_format``, ``logit_bias``, ``parallel_tool_calls: false`` (the policy's action is what it
decoded, every call in it); and ``logprobs: true`` / ``top_logprobs`` (the behaviour log-probs stay
with the trajectory the learner trains on; an agent program does not get them). A body that is not
JSON, or nested past what a parser should follow, answers 400; a conversation the episode cannot
encode as a continuation of its context answers 400 at once, with the reason. It serves no request
outside an episode.
"""

from __future__ import annotations

import asyncio
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class ChatRequest:
  """A chat request as the episode reads it (checked field by field by ``_parse``)."""
  messages: list  # [{"role", "content", optional "tool_calls" / "tool_call_id"}], content as text
  stop: Optional[tuple] = None
  tools: Optional[list] = None  # OpenAI function tools: [{"type": "function", "function": {...}}]
  max_tokens: Optional[int] = None
  temperature: Optional[float] = None
  top_p: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class ChatReply:
  """The policy's answer: its text outside tool calls, the calls (OpenAI ``tool_calls``), why it
  ended (``stop``, ``tool_calls``, ``length``) and the token counts."""
  content: str
  tool_calls: tuple = ()
  finish_reason: str = "stop"
  prompt_tokens: int = 0
  completion_tokens: int = 0


class ChatEndpoint:
  """The HTTP server, on its own thread and event loop. ``register(episode_id, handler)``: requests
  of that episode go to ``handler(ChatRequest) -> Future[ChatReply]`` (it may raise
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

  def register(self, episode_id: str, handler: Callable, answer_timeout: Optional[float] = None) -> None:
    """Requests of ``episode_id`` go to ``handler``; each waits at most ``answer_timeout`` seconds
    for its answer (the endpoint's own by default)."""
    with self._lock:
      self._handlers[episode_id] = (handler, answer_timeout or self.answer_timeout)

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
    except RecursionError:
      return _error(400, "the request body is nested too deeply to parse")
    episode_id = request.headers.get(EPISODE_HEADER, "")
    with self._lock:
      handler, timeout = self._handlers.get(episode_id, (None, self.answer_timeout))
    if handler is None:
      return _error(404, f"no episode {episode_id!r} in progress on this endpoint (header {EPISODE_HEADER})")
    try:
      chat = _parse(body)
      answer = handler(chat)
    except RequestError as e:
      return _error(400, str(e))
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # bad input never answers 500
      return _error(400, f"malformed request: {type(e).__name__}: {e}"[:300])
    try:
      reply = await asyncio.wait_for(asyncio.wrap_future(answer), timeout)
    except asyncio.TimeoutError:
      return _error(504, f"episode {episode_id}: no answer within {timeout:g}s")
    except RequestError as e:
      return _error(400, str(e))
    except Exception as e:  # pylint: disable=broad-except  (the episode ended without an answer)
      return _error(409, f"episode {episode_id}: {e}")
    message = {"role": "assistant", "content": reply.content if reply.content or not reply.tool_calls else None}
    if reply.tool_calls:
      message["tool_calls"] = reply.tool_calls
    return web.json_response({
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": str(body.get("model") or MODEL_NAME),
        "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                  "total_tokens": reply.prompt_tokens + reply.completion_tokens}})

  def close(self) -> None:
    self._loop.call_soon_threadsafe(self._loop.stop)


# request fields an agent framework sends, with the type each must have; fields that would change
# the behaviour policy the learner records are accepted only at their neutral values (below), or
# (temperature, top_p) at the run's, which the episode checks
_NUMBER = (int, float)
_TYPES = {"model": str, "stream": (bool, type(None)), "n": (int, type(None)), "stop": (str, list, type(None)),
          "temperature": (*_NUMBER, type(None)), "top_p": (*_NUMBER, type(None)),
          "max_tokens": (int, type(None)), "max_completion_tokens": (int, type(None)),
          "seed": (int, type(None)), "user": str, "presence_penalty": (*_NUMBER, type(None)),
          "frequency_penalty": (*_NUMBER, type(None)), "logprobs": (bool, type(None)),
          "top_logprobs": (int, type(None)), "tools": (list, type(None)),
          "tool_choice": (str, dict, type(None)), "parallel_tool_calls": (bool, type(None)),
          "store": (bool, type(None)), "metadata": (dict, type(None)), "stream_options": (dict, type(None)),
          "response_format": (dict, type(None)), "logit_bias": (dict, type(None))}
_ROLES = ("system", "developer", "user", "assistant", "tool")


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


def _tool_calls(i: int, calls) -> list:
  if not isinstance(calls, list):
    raise RequestError(f"messages[{i}].tool_calls must be a list")
  out = []
  for j, call in enumerate(calls):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
        or not isinstance(function.get("arguments", ""), str):
      raise RequestError(f"messages[{i}].tool_calls[{j}] needs a function with a string name and "
                         "arguments (a JSON string)")
    out.append({"id": str(call.get("id", "")), "type": "function",
                "function": {"name": function["name"], "arguments": function.get("arguments", "")}})
  return out


def _tools(tools) -> Optional[list]:
  if not tools:
    return None
  out = []
  for k, tool in enumerate(tools):
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
        or not isinstance(function, dict) or not isinstance(function.get("name"), str) \
        or not isinstance(function.get("parameters", {}), dict):
      raise RequestError(f"tools[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                         "\"parameters\": {...}}}")
    out.append({"type": "function", "function": dict(function)})
  return out


def _parse(body) -> ChatRequest:
  """The request as a ``ChatRequest``; a ``RequestError`` naming the first bad field."""
  if not isinstance(body, dict):
    raise RequestError("the request body must be a JSON object")
  for field, kind in _TYPES.items():
    if field in body and (not isinstance(body[field], kind)
                          or (isinstance(body[field], bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)))):
      raise RequestError(f"{field}={body[field]!r}: wrong type")
  if body.get("stream"):
    raise RequestError("stream: streaming is not supported (stream must be false)")
  if body.get("n") not in (None, 1):
    raise RequestError("n must be 1 (an episode is one trajectory)")
  for field, neutral in (("presence_penalty", 0), ("frequency_penalty", 0)):
    if body.get(field) not in (None, neutral):
      raise RequestError(f"{field} must be {neutral}: it would change the sampling policy the learner "
                         "records (the run's rollout settings decide it)")
  if body.get("logprobs") or body.get("top_logprobs"):
    raise RequestError("logprobs / top_logprobs are not returned: the behaviour log-probs stay with the "
                       "trajectory the learner trains on (leave logprobs false)")
  if body.get("parallel_tool_calls") is False:
    raise RequestError("parallel_tool_calls=false is not supported: the policy's answer is what it "
                       "decoded, with every tool call in it (leave it out, or true)")
  if body.get("tool_choice") not in (None, "auto"):
    raise RequestError("tool_choice must be \"auto\": forcing or forbidding a tool call would change the "
                       "sampling policy the learner records")
  for field in ("response_format", "logit_bias"):
    if body.get(field) and body[field] != {"type": "text"}:
      raise RequestError(f"{field} is not supported: it would change the sampling policy the learner records")
  for field in ("max_tokens", "max_completion_tokens"):
    if body.get(field) is not None and body[field] < 1:
      raise RequestError(f"{field}={body[field]}: must be >= 1")
  limit = body.get("max_completion_tokens")
  limit = body.get("max_tokens") if limit is None else limit
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise RequestError("messages must be a non-empty list")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
      raise RequestError(f"messages[{i}] needs a role, one of {list(_ROLES)}")
    message = {"role": m["role"]}
    if m["role"] == "assistant" and m.get("tool_calls"):
      message["content"] = "" if m.get("content") is None else _content(i, m["content"])
      message["tool_calls"] = _tool_calls(i, m["tool_calls"])
    elif "content" not in m or m["content"] is None:
      raise RequestError(f"messages[{i}].content is missing")
    else:
      message["content"] = _content(i, m["content"])
    if m["role"] == "tool":
      if not isinstance(m.get("tool_call_id", ""), str):
        raise RequestError(f"messages[{i}].tool_call_id must be a string")
      message["tool_call_id"] = m.get("tool_call_id", "")
    out.append(message)
  stop = body.get("stop")
  if isinstance(stop, str):
    stop = (stop,)
  elif stop is not None:
    if not all(isinstance(s, str) for s in stop):
      raise RequestError("stop must be a string or a list of strings")
    stop = tuple(stop)
  return ChatRequest(messages=out, stop=stop, tools=_tools(body.get("tools")), max_tokens=limit,
                     temperature=body.get("temperature"), top_p=body.get("top_p"))


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

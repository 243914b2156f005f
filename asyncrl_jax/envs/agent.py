"""Agent programs written against an OpenAI-compatible client, trained as they are: the program is the
episode's environment.

``env.name="openai-agent"``, ``env.options='{"program": "package.module:function"}'``. For each
episode the decode server calls ``function(client_config, problem)`` on a thread of its own, where
``client_config`` is ``{"base_url", "api_key", "default_headers"}`` (``openai.OpenAI(**client_config)``
talks to this process's chat endpoint, ``envs.chat_endpoint``, under the episode's id) and ``problem``
is ``{"question", "answer"}``; it returns the episode's reward. Each chat request becomes a turn:

* the first request is the episode's prompt: its messages (a system message, the user's task) and its
  ``tools`` rendered by the chat template (``Tokenizer.encode_chat``); the environment waits for it
  when the episode starts (``reset``, off the decode loop, within ``call_timeout``), so the prompt the
  policy decodes from is the program's, not the controller's rendering of the problem;
* every later request must extend the conversation so far (the previous messages, then the answer
  it was given as an assistant message, tool calls included) with the same ``tools``; what its new
  messages add (tool results, the next user message, the template's markers) is the turn's
  observation: context, never a policy action (``Tokenizer.encode_chat_continuation``);
* the answer is the policy's next action, decoded in the episode's slot, ending at the end of
  sequence, at one of ``stop`` (an option, fixed per episode; by default the tokenizer's
  ``tool_call_stop``: a request asking for other stop sequences is refused) or at the request's
  ``max_tokens`` (finish reason ``length``). Tool calls in it, in the tokenizer's format, come back
  as ``tool_calls`` (finish reason ``tool_calls``); the content leaves the stop sequence out.
* ``temperature`` and ``top_p``, if sent, must be the run's (``rollout.temperature``, ``top_p``): the
  learner corrects for the policy the decode server samples, so a request cannot change it.

The program runs in the decode server's process with its rights: it is trusted code, like a reward
function, not model-written code (that belongs in ``envs.python_tool``). A program that raises ends
its episode as ``env_error``; one that makes no request for ``call_timeout`` seconds, as
``env_error`` too. When the episode ends for any other reason (the token budget, an abort, the
server stopping), a request still waiting is answered 409 and the episode's id is released.
"""

from __future__ import annotations

import importlib
import json
import queue
import threading
import uuid
from concurrent import futures
from typing import Callable, Optional

from asyncrl_jax.envs import chat_endpoint
from asyncrl_jax.envs.base import StepResult, register
from asyncrl_jax.infra import auth
from asyncrl_jax.tokenization import TokenizerError

_ENDED = "the episode ended"


def load_program(spec: str) -> Callable:
  module, _, name = spec.partition(":")
  if not module or not name:
    raise ValueError(f"program={spec!r}: give it as 'package.module:function'")
  try:
    program = getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"program={spec!r}: {e}") from None
  if not callable(program):
    raise ValueError(f"program={spec!r} is not callable")
  return program


@register("openai-agent")
class AgentEnvironment:
  """One episode of an agent program (see the module's docstring)."""

  def __init__(self, program: str, tokenizer=None, sampling: Optional[dict] = None, stop=None,
               host: str = "127.0.0.1", port: int = 0, call_timeout: float = 60.0,
               step_timeout: Optional[float] = None):
    if tokenizer is None:
      raise ValueError("the agent environment needs the decode server's tokenizer (its chat template)")
    self.program_spec, self._program = program, load_program(program)
    self.tokenizer = tokenizer
    if stop is None:
      stop = tokenizer.tool_call_stop
    self.stop = tuple([stop] if isinstance(stop, str) else stop)
    self.call_timeout = call_timeout
    # how long a request waits for the policy's answer: the decode server's step timeout (its
    # ``env.step_timeout``), after which the episode ends anyway
    self.step_timeout = step_timeout
    self._sampling = dict(sampling or {})
    self._endpoint = chat_endpoint.shared(host, port, auth.load_token())
    self._events: "queue.Queue[tuple]" = queue.Queue()
    self._pending: Optional[tuple] = None  # (request, answer future) of the request being answered
    self._history: list = []
    self._tools: Optional[list] = None
    self._context = 0  # tokens in the episode's context so far (usage.prompt_tokens)
    self.max_action_tokens: Optional[int] = None  # the pending request's max_tokens (the decode server reads it)
    self.episode_id = ""
    self._closed = False
    self._close_lock = threading.Lock()  # a request is queued before close drains, or refused after

  def reset(self, problem: dict) -> list:
    """Starts the program and waits for its first request; returns the episode's prompt (its token
    ids)."""
    self.episode_id = uuid.uuid4().hex
    self._closed = False
    self._endpoint.register(self.episode_id, self._request, self.step_timeout)
    config = {"base_url": self._endpoint.base_url, "api_key": auth.load_token() or "loopback",
              "default_headers": {chat_endpoint.EPISODE_HEADER: self.episode_id}}

    def run():
      try:
        self._events.put(("end", float(self._program(config, dict(problem)))))
      except Exception as e:  # pylint: disable=broad-except  (ends the episode as env_error)
        self._events.put(("error", f"{type(e).__name__}: {e}"))

    threading.Thread(target=run, daemon=True, name=f"agent-{self.episode_id[:8]}").start()
    event = self._next()
    if event[0] != "request":
      raise RuntimeError(f"the agent program {'failed' if event[0] == 'error' else 'returned'} before its "
                         f"first request" + (f": {event[1]}" if event[0] == "error" else ""))
    _, chat, answer = event
    self._tools = chat.tools
    self._accept(chat, answer)
    try:
      prompt = self.tokenizer.encode_chat(chat.messages, chat.tools)
    except TokenizerError as e:
      error = f"the conversation cannot be encoded: {e}"
      answer.set_exception(chat_endpoint.RequestError(error))
      self._pending = None
      raise chat_endpoint.RequestError(error) from None
    self._context = len(prompt)
    return prompt

  def _request(self, chat: "chat_endpoint.ChatRequest") -> futures.Future:
    """A chat request of this episode (on the endpoint's thread)."""
    if chat.stop is not None and tuple(chat.stop) != self.stop:
      raise chat_endpoint.RequestError(
          f"stop={list(chat.stop)} differs from this run's {list(self.stop)} (env.options stop): the "
          "policy's actions end where the run says")
    for field in ("temperature", "top_p"):
      sent, run = getattr(chat, field), self._sampling.get(field)
      if sent is not None and run is not None and abs(float(sent) - float(run)) > 1e-6:
        raise chat_endpoint.RequestError(
            f"{field}={sent} differs from the run's {run} (rollout.{field}): the learner corrects for the "
            "policy the decode servers sample; leave it out or send the run's value")
    if self.tokenizer.tool_call_stop and chat.tools and not _one_argument(chat.tools):
      raise chat_endpoint.RequestError(
          "tools: the built-in vocabulary's tool call names no function and carries one argument: give "
          "exactly one function with exactly one parameter")
    answer: futures.Future = futures.Future()
    with self._close_lock:
      if self._closed:  # (it found the handler before the id was released)
        answer.set_exception(RuntimeError(_ENDED))
      else:
        self._events.put(("request", chat, answer))
    return answer

  def _next(self) -> tuple:
    try:
      return self._events.get(timeout=self.call_timeout)
    except queue.Empty:
      raise TimeoutError(f"the agent program made no request and did not return within "
                         f"{self.call_timeout:g}s") from None

  def _accept(self, chat, answer) -> None:
    self._pending, self._history = (chat, answer), list(chat.messages)
    self.max_action_tokens = chat.max_tokens

  def step(self, action: str) -> StepResult:
    chat, answer = self._pending
    reply, message = self._reply(action)
    history = self._history + [message]
    answer.set_result(reply)
    self._pending = None
    event = self._next()
    if event[0] != "request":
      return self._ended(event)
    _, chat, answer = event
    error = ""
    if chat.tools != self._tools:
      error = "tools differ from the episode's first request's (the prompt the policy was given)"
    elif [_normal(m) for m in chat.messages[:len(history)]] != [_normal(m) for m in history]:
      error = ("the messages do not continue the episode's conversation (the earlier messages, then the "
               "answers given as assistant messages, unchanged)")
    if error:
      answer.set_exception(chat_endpoint.RequestError(error))
      raise chat_endpoint.RequestError(error)
    new = chat.messages[len(history):]
    try:
      tokens = self.tokenizer.encode_chat_continuation(history, new, self._tools)
    except TokenizerError as e:  # answered at once (400), not left to time out
      error = f"the conversation cannot continue the episode's context: {e}"
      answer.set_exception(chat_endpoint.RequestError(error))
      raise chat_endpoint.RequestError(error) from None
    self._accept(chat, answer)
    self._context += reply.completion_tokens + len(tokens)
    info = {"messages": len(new)}
    if reply.tool_calls:
      info["tool"] = ",".join(c["function"]["name"] for c in reply.tool_calls)
    return StepResult(observation=tokens, info=info)

  def _reply(self, action: str) -> tuple:
    """The answer to the pending request (``ChatReply``) and the assistant message it adds."""
    text = str(action)
    content, calls = self.tokenizer.parse_tool_calls(text)
    if not calls:
      content = next((text[:-len(s)] for s in self.stop if s and text.endswith(s)), text)
    tool_calls = []
    for call in calls:
      name, arguments = call["name"], call["arguments"]
      if name is None:  # the built-in form: the conversation's one tool, its one argument
        function = self._tools[0]["function"] if self._tools else {"name": "tool", "parameters": {}}
        name = function["name"]
        arguments = {_parameter(function): arguments}
      tool_calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                         "function": {"name": name, "arguments": json.dumps(arguments)}})
    tokens = getattr(action, "tokens", None)
    finish = ("tool_calls" if tool_calls else
              "length" if getattr(action, "ended", "") == "max_tokens" else "stop")
    reply = chat_endpoint.ChatReply(
        content=content, tool_calls=tuple(tool_calls), finish_reason=finish, prompt_tokens=self._context,
        completion_tokens=len(tokens) if tokens is not None else len(self.tokenizer.encode(text)))
    message = {"role": "assistant", "content": content}
    if tool_calls:
      message["tool_calls"] = tool_calls
    return reply, message

  def _ended(self, event: tuple) -> StepResult:
    if event[0] == "error":
      raise RuntimeError(f"the agent program failed: {event[1]}")
    return StepResult(reward=float(event[1]), done=True, info={"ended": "program returned"})

  def close(self) -> None:
    """The episode ended (any reason): a request still waiting gets an error (409), the id is
    released. The id goes first, so a program that reacts to the 409 by asking again finds no
    episode (404)."""
    self._endpoint.unregister(self.episode_id)
    with self._close_lock:
      self._closed = True
    if self._pending is not None and not self._pending[1].done():
      self._pending[1].set_exception(RuntimeError(_ENDED))
    while True:
      try:
        event = self._events.get_nowait()
      except queue.Empty:
        break
      if event[0] == "request" and not event[2].done():
        event[2].set_exception(RuntimeError(_ENDED))


def _parameter(function: dict) -> str:
  """The name of a function's one parameter (``"input"`` if its schema names none)."""
  properties = (function.get("parameters") or {}).get("properties") or {}
  return next(iter(properties), "input")


def _one_argument(tools: list) -> bool:
  return len(tools) == 1 and len(((tools[0]["function"].get("parameters") or {}).get("properties")
                                  or {"input": 0})) == 1


def _normal(m: dict) -> tuple:
  """A message as compared between requests: role, text, tool calls (name and decoded arguments;
  ids aside), and the id a tool message answers."""
  calls = []
  for c in m.get("tool_calls") or ():
    arguments = c["function"].get("arguments", "")
    try:
      arguments = json.dumps(json.loads(arguments), sort_keys=True)
    except (json.JSONDecodeError, TypeError):
      pass
    calls.append((c["function"]["name"], arguments))
  return (m.get("role"), m.get("content") or "", tuple(calls))

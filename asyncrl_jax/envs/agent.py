"""Agent programs written against an OpenAI-compatible client, trained as they are: the program is the
episode's environment.

``env.name="openai-agent"``, ``env.options='{"program": "package.module:function"}'``. For each
episode the decode server calls ``function(client_config, problem)`` on a thread of its own, where
``client_config`` is ``{"base_url", "api_key", "default_headers"}`` (``openai.OpenAI(**client_config)``
talks to this process's chat endpoint, ``envs.chat_endpoint``, under the episode's id) and ``problem``
is ``{"question", "answer"}``; it returns the episode's reward. Each chat request becomes a turn:

* its messages must extend the conversation so far (the previous messages, then the answer it was
  given as an assistant message); the first request must render to the episode's prompt (the
  problem's question as one user message, as the task renders every prompt);
* what the new messages add (tool results, the next user message, the chat template's markers) is
  the turn's observation: context, never a policy action (``Tokenizer.encode_chat_continuation``);
* the answer is the policy's next action, decoded in the episode's slot, ending at the end of
  sequence or at one of ``stop`` (an option, fixed per episode: the first action is decoded before
  the first request arrives; a request asking for other stop sequences is refused). As with the
  OpenAI API, the returned content leaves the stop sequence out.

The program runs in the decode server's process with its rights: it is trusted code, like a reward
function, not model-written code (that belongs in ``envs.python_tool``). A program that raises ends
its episode as ``env_error``; one that makes no request for ``call_timeout`` seconds, as
``env_error`` too.
"""

from __future__ import annotations

import importlib
import queue
import threading
import uuid
from concurrent import futures
from typing import Callable, Optional

from asyncrl_jax.envs import chat_endpoint
from asyncrl_jax.envs.base import StepResult, register
from asyncrl_jax.infra import auth

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

  def __init__(self, program: str, tokenizer=None, stop=(), host: str = "127.0.0.1", port: int = 0,
               call_timeout: float = 60.0):
    if tokenizer is None:
      raise ValueError("the agent environment needs the decode server's tokenizer (its chat template)")
    self.program_spec, self._program = program, load_program(program)
    self.tokenizer, self.stop = tokenizer, tuple([stop] if isinstance(stop, str) else stop)
    self.call_timeout = call_timeout
    self._endpoint = chat_endpoint.shared(host, port, auth.load_token())
    self._events: "queue.Queue[tuple]" = queue.Queue()
    self._pending: Optional[tuple] = None  # (messages, answer future) of the request being answered
    self._history: Optional[list] = None
    self._problem: dict = {}
    self.episode_id = ""

  def reset(self, problem: dict) -> str:
    self._problem = dict(problem)
    self.episode_id = uuid.uuid4().hex
    self._endpoint.register(self.episode_id, self._request)
    config = {"base_url": self._endpoint.base_url, "api_key": auth.load_token() or "loopback",
              "default_headers": {chat_endpoint.EPISODE_HEADER: self.episode_id}}

    def run():
      try:
        self._events.put(("end", float(self._program(config, dict(problem)))))
      except Exception as e:  # pylint: disable=broad-except  (ends the episode as env_error)
        self._events.put(("error", f"{type(e).__name__}: {e}"))

    threading.Thread(target=run, daemon=True, name=f"agent-{self.episode_id[:8]}").start()
    return str(problem.get("question", ""))

  def _request(self, messages: list, stop) -> futures.Future:
    """A chat request of this episode (on the endpoint's thread)."""
    if stop is not None and tuple(stop) != self.stop:
      raise chat_endpoint.RequestError(
          f"stop={list(stop)} differs from this run's {list(self.stop)} (env.options stop): the "
          "policy's actions end where the run says")
    answer: futures.Future = futures.Future()
    self._events.put(("request", messages, answer))
    return answer

  def _next(self) -> tuple:
    try:
      return self._events.get(timeout=self.call_timeout)
    except queue.Empty:
      raise TimeoutError(f"the agent program made no request and did not return within "
                         f"{self.call_timeout:g}s") from None

  def step(self, action: str) -> StepResult:
    if self._pending is None:  # the first action: answers the program's first request
      event = self._next()
      if event[0] != "request":
        return self._ended(event)
      _, messages, answer = event
      try:
        self._check_first(messages)
      except chat_endpoint.RequestError as e:
        answer.set_exception(e)
        raise
      self._pending, self._history = (messages, answer), list(messages)
    content, finish = self._content(action)
    self._history.append({"role": "assistant", "content": content})
    self._pending[1].set_result((content, finish))
    self._pending = None
    event = self._next()
    if event[0] != "request":
      return self._ended(event)
    _, messages, answer = event
    history = self._history
    if messages[:len(history)] != history:
      error = chat_endpoint.RequestError(
          "the messages do not continue the episode's conversation (the earlier messages, then the "
          "answers given as assistant messages, unchanged)")
      answer.set_exception(error)
      raise error
    self._pending, self._history = (messages, answer), list(messages)
    tokens = self.tokenizer.encode_chat_continuation(history, messages[len(history):])
    return StepResult(observation=tokens, info={"messages": len(messages) - len(history)})

  def _check_first(self, messages: list) -> None:
    want = self.tokenizer.encode_prompt(str(self._problem.get("question", "")))
    if self.tokenizer.encode_chat(messages) != want:
      raise chat_endpoint.RequestError(
          "the first request's messages render to other tokens than the episode's prompt: send the "
          "problem's question as one user message")

  def _content(self, action: str) -> tuple[str, str]:
    for s in self.stop:
      if action.endswith(s):
        return action[:-len(s)], "stop"
    return action, "stop"

  def _ended(self, event: tuple) -> StepResult:
    if event[0] == "error":
      raise RuntimeError(f"the agent program failed: {event[1]}")
    return StepResult(reward=float(event[1]), done=True, info={"ended": "program returned"})

  def close(self) -> None:
    """The episode ended (any reason): a request still waiting gets an error, the id is released."""
    if self._pending is not None and not self._pending[1].done():
      self._pending[1].set_exception(RuntimeError(_ENDED))
    while True:
      try:
        event = self._events.get_nowait()
      except queue.Empty:
        break
      if event[0] == "request" and not event[2].done():
        event[2].set_exception(RuntimeError(_ENDED))
    self._endpoint.unregister(self.episode_id)

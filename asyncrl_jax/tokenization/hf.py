"""Hugging Face tokenizers: ``tokenizer.json`` through the ``tokenizers`` package, chat template from
``tokenizer_config.json`` rendered with Jinja (sandboxed, as transformers does)."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional, Sequence

import jinja2
import jinja2.sandbox
import tokenizers

from asyncrl_jax.tokenization.base import Tokenizer, TokenizerError


def _token_text(value) -> Optional[str]:
  if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
    return value.get("content")
  return value


def _for_template(message: dict) -> dict:
  """An OpenAI message as chat templates read it: ``content`` None as "", and each tool call's
  ``arguments`` (a JSON string in the API) as the object it encodes (Qwen2.5's template writes it
  with ``tojson``)."""
  m = dict(message)
  if m.get("content") is None:
    m["content"] = ""
  if m.get("tool_calls"):
    calls = []
    for call in m["tool_calls"]:
      call = dict(call)
      function = dict(call.get("function") or {})
      if isinstance(function.get("arguments"), str):
        try:
          function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError:
          pass
      call["function"] = function
      calls.append(call)
    m["tool_calls"] = calls
  return m


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  """Chat templates' ``tojson`` as transformers defines it: plain JSON, keys in their order, no HTML
  escaping (Jinja's own sorts keys and escapes ``<>&'``, so tool calls would render otherwise)."""
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):
  raise TokenizerError(f"chat template: {message}")


class HFTokenizer(Tokenizer):
  """A tokenizer directory: ``tokenizer.json`` and optionally ``tokenizer_config.json``.

  Args:
    path: the directory.
    system_prompt: if given, prepended as a system turn by ``encode_prompt``.
    template_kwargs: what the chat template gets beside the messages (``data.chat_template_kwargs``,
      e.g. ``{"enable_thinking": False}``); part of the tokenizer's ``identity``.
  """

  TEMPLATE_ARGUMENTS = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")

  def __init__(self, path: str, *, system_prompt: Optional[str] = None, template_kwargs: Optional[dict] = None):
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
      raise TokenizerError(f"{path}: missing tokenizer.json")
    try:
      self._tok = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # the Rust library raises a plain Exception
      raise TokenizerError(f"{file}: cannot be parsed ({e})") from None
    config = {}
    config_file = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(config_file):
      try:
        with open(config_file) as f:
          config = json.load(f)
      except json.JSONDecodeError as e:
        raise TokenizerError(f"{config_file}: not valid JSON ({e})") from None
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.bos_token = _token_text(config.get("bos_token"))
    self.eos_token = _token_text(config.get("eos_token"))
    self.pad_token = _token_text(config.get("pad_token"))
    self.bos_id = self._id(self.bos_token)
    self.eos_id = self._id(self.eos_token)
    if self.eos_id is None:
      raise TokenizerError(f"{path}: tokenizer_config.json names no eos_token present in the vocabulary")
    pad = self._id(self.pad_token)
    self.pad_id = self.eos_id if pad is None else pad
    self.system_prompt = system_prompt
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      template = next((t["template"] for t in template if t.get("name") == "default"), None)
    self.chat_template = template
    if template:
      env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
      env.globals["raise_exception"] = _raise
      env.filters["tojson"] = _tojson
      self._template = env.from_string(template)
    else:
      self._template = None
    self.template_kwargs = dict(template_kwargs or {})
    bad = sorted(set(self.template_kwargs) & set(self.TEMPLATE_ARGUMENTS))
    if bad:
      raise TokenizerError(f"chat template arguments {bad} are given by the tokenizer itself")
    if self.template_kwargs and not template:
      raise TokenizerError(f"{path}: chat template arguments {sorted(self.template_kwargs)} given, but "
                           "tokenizer_config.json has no chat_template")
    # (the arguments change every prompt: a decode server with others is a different tokenizer)
    kwargs = json.dumps(self.template_kwargs, sort_keys=True) if self.template_kwargs else ""
    digest = hashlib.sha256(open(file, "rb").read() + (template or "").encode() + kwargs.encode()).hexdigest()[:12]
    self.identity = f"hf:{os.path.basename(os.path.normpath(path))}:{digest}"

  def _id(self, token: Optional[str]) -> Optional[int]:
    return None if token is None else self._tok.token_to_id(token)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise TokenizerError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
    return self._tok.decode(ids, skip_special_tokens=True)

  def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                  tools: Optional[list] = None) -> str:
    if self._template is None:
      raise TokenizerError("tokenizer_config.json has no chat_template")
    extra = dict(self.template_kwargs, **({"tools": tools} if tools else {}))
    return self._template.render(messages=[_for_template(m) for m in messages],
                                 add_generation_prompt=add_generation_prompt,
                                 bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)

  def encode_chat(self, messages: list, tools: Optional[list] = None) -> list[int]:
    return self.encode(self.render_chat(messages, tools=tools))

  def encode_chat_continuation(self, history: list, new: list, tools: Optional[list] = None) -> list[int]:
    """The text the template adds for ``new`` (and the next generation prompt), encoded alone; the
    template must render ``history`` as a prefix of ``history + new``. Reasoning templates (Qwen3's,
    DeepSeek-R1's) do so while ``new`` holds tool results, but drop the ``<think>`` sections of the
    assistant turns before the last user message: a new user turn after a reasoning turn rewrites
    the context the model decoded, which an episode cannot continue (refused, naming the turn)."""
    before = self.render_chat(history, add_generation_prompt=False, tools=tools)
    after = self.render_chat(history + new, tools=tools)
    if not after.startswith(before):
      at = next((i for i in range(min(len(before), len(after))) if before[i] != after[i]),
                min(len(before), len(after)))
      hint = ""
      if any(m.get("role") == "user" for m in new) and any(
          m.get("role") == "assistant" and (m.get("reasoning_content") or "</think>" in (m.get("content") or ""))
          for m in history):
        hint = (" (a new user turn after an assistant turn with reasoning: the template drops that "
                "reasoning from the context, so the conversation so far is no longer what was decoded; "
                "start a new conversation, or strip the reasoning from the assistant turn)")
      raise TokenizerError("the chat template does not render the conversation so far as a prefix of "
                           f"the longer one (they differ from character {at}: {before[at:at + 40]!r} "
                           f"against {after[at:at + 40]!r}); its continuation is not defined" + hint)
    return self.encode(after[len(before):])

  def encode_prompt(self, question: str) -> list[int]:
    """Chat-templated user turn; without a template, ``bos + question``."""
    if self._template is None:
      ids = self.encode(question)
      return ([self.bos_id] if self.bos_id is not None else []) + ids
    messages = [{"role": "user", "content": question}]
    if self.system_prompt:
      messages.insert(0, {"role": "system", "content": self.system_prompt})
    return self.encode(self.render_chat(messages))

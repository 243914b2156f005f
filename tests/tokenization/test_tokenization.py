"""Tokenizers: the built-in one, and tokenizer.json + chat template against transformers."""

import json

import numpy as np
import pytest
import tokenizers
import transformers
from tokenizers import models as tok_models
from tokenizers import pre_tokenizers

from asyncrl_jax.data import arithmetic
from asyncrl_jax.tokenization import (ArithmeticTokenizer, HFTokenizer, TokenizerError, ToolTokenizer,
                                      load_tokenizer)
from asyncrl_jax.tokenization.base import Tokenizer

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}")


def test_builtin_round_trip_and_vocab():
  tok = load_tokenizer("")
  assert isinstance(tok, ArithmeticTokenizer) and tok.vocab_size == 17
  problem = arithmetic.make_problem(np.random.default_rng(0))
  ids = tok.encode(problem.solution)
  assert tok.decode(ids) == problem.solution
  assert tok.encode_prompt("1+2=") == [1, 4, 13, 5, 17 - 3]
  assert tok.decode([1, 4, 2, 0]) == "1"
  with pytest.raises(TokenizerError, match="'x' is not in the built-in vocabulary"):
    tok.encode("1+x")
  with pytest.raises(TokenizerError, match="outside the built-in vocabulary"):
    tok.decode([17])


def test_arithmetic_problems_are_correct_and_heavy_tailed():
  rng = np.random.default_rng(1)
  problems = [arithmetic.make_problem(rng) for _ in range(3000)]
  for p in problems[:200]:
    digits = [int(x) for x in p.question[:-1].split("+")]
    assert int(p.answer) == sum(digits) and len(digits) == p.num_terms
    assert arithmetic.reward(p.solution, p.answer) == 1.0
    assert arithmetic.reward(p.solution + "1", p.answer) == 0.0
  terms = np.array([p.num_terms for p in problems])
  assert np.median(terms) == 3 and terms.max() >= 9 and terms.min() == 2


@pytest.fixture()
def hf_dir(tmp_path):
  words = ["<|im_start|>", "<|im_end|>", "<unk>", "user", "assistant", "system", "what", "is", "1", "+",
           "2", "?", "\n", "be", "brief"]
  tok = tokenizers.Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split(pattern=tokenizers.Regex(r"<\|im_(start|end)\|>|\n| |\w+|[^\w\s]"),
                                           behavior="isolated")
  tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
  tok.save(str(tmp_path / "tokenizer.json"))
  with open(tmp_path / "tokenizer_config.json", "w") as f:
    json.dump({"eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE,
               "tokenizer_class": "PreTrainedTokenizerFast"}, f)
  return tmp_path


def test_hf_tokenizer_matches_transformers_chat_template(hf_dir):
  ours = HFTokenizer(str(hf_dir))
  ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"),
                                             eos_token="<|im_end|>")
  ref.chat_template = CHAT_TEMPLATE
  messages = [{"role": "user", "content": "what is 1+2?"}]
  want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  if isinstance(want, dict) or hasattr(want, "keys"):
    want = want["input_ids"]
  assert ours.encode_prompt("what is 1+2?") == list(want)
  assert ours.eos_id == 1 and ours.pad_id == 1 and ours.stop_ids == (1,)
  assert "<|im_start|>" not in ours.decode(ours.encode_prompt("what is 1+2?"))
  with_system = HFTokenizer(str(hf_dir), system_prompt="be brief")
  assert with_system.encode_prompt("what")[:3] == [0, 5, 12]
  assert ours.identity.startswith("hf:") and len(ours.identity) > len("hf::")


def test_chat_continuations_match_transformers_and_the_built_in_template(hf_dir):
  """A chat client's next request adds to the context exactly what the template renders after the
  conversation so far (tool results, the next user turn, the generation prompt)."""
  ours = HFTokenizer(str(hf_dir))
  ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"),
                                             eos_token="<|im_end|>")
  ref.chat_template = CHAT_TEMPLATE
  history = [{"role": "user", "content": "what is 1+2?"}, {"role": "assistant", "content": "2"}]
  new = [{"role": "user", "content": "be brief"}]
  render = lambda m, g: ref.apply_chat_template(m, add_generation_prompt=g, tokenize=False)  # noqa: E731
  assert ours.encode_chat(history[:1]) == ours.encode_prompt("what is 1+2?")
  delta = render(history + new, True)[len(render(history, False)):]
  assert delta.startswith("<|im_start|>user") and delta.endswith("<|im_start|>assistant\n")
  assert ours.encode_chat_continuation(history, new) == ours.encode(delta)
  whole = ours.encode(render(history + new, True))
  assert ours.encode(render(history, False)) + ours.encode_chat_continuation(history, new) == whole
  # the built-in template: <bos> and the contents as they are, so one user turn is the task's prompt
  tool = ToolTokenizer()
  assert tool.encode_chat([{"role": "user", "content": "12+3="}]) == tool.encode_prompt("12+3=")
  assert tool.encode_chat_continuation(
      [{"role": "user", "content": "12+3="}, {"role": "assistant", "content": "[12+3"}],
      [{"role": "tool", "content": "15"}]) == tool.encode("{15}")
  # its form of standard tool calls: "[args]" calls the one tool; a tool message renders as "{...}"
  assert tool.parse_tool_calls("3+4=7;[7+5]") == ("3+4=7;", [{"name": None, "arguments": "7+5"}])
  assert tool.parse_tool_calls("#12") == ("#12", []) and tool.tool_call_stop == ("]",)
  call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "7+5"}'}}
  assert tool.encode_chat([{"role": "user", "content": "1="},
                           {"role": "assistant", "content": "3+4=7;", "tool_calls": [call]},
                           {"role": "tool", "content": "12"}]) == tool.encode_prompt("1=3+4=7;[7+5]{12}")
  with pytest.raises(TokenizerError, match="has no chat template"):  # (a tokenizer that defines none)
    Tokenizer.encode_chat(tool, [])


def test_hermes_tool_calls_parse_and_render_as_transformers_does(hf_dir):
  """Qwen2.5 / Hermes tool calls: parsed out of an action's text; an assistant message with
  ``tool_calls`` (OpenAI's arguments, a JSON string) renders as transformers renders it with the
  arguments as an object; ``tools`` reach the template."""
  ours = HFTokenizer(str(hf_dir))
  text = 'let me add\n<tool_call>\n{"name": "calc", "arguments": {"e": "7+5"}}\n</tool_call>'
  assert ours.parse_tool_calls(text) == ("let me add", [{"name": "calc", "arguments": {"e": "7+5"}}])
  # not a call: bad JSON, or no name (left in the content, as the policy wrote it)
  for bad in ('<tool_call>{"name": 3}</tool_call>', "<tool_call>{oops</tool_call>"):
    assert ours.parse_tool_calls(bad) == (bad, [])
  template = ("{% if tools %}TOOLS{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
              "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_calls %}"
              "{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
              "{% endif %}\n{% endfor %}")
  config = json.loads((hf_dir / "tokenizer_config.json").read_text())
  (hf_dir / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=template)))
  ours = HFTokenizer(str(hf_dir))
  ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"),
                                             eos_token="<|im_end|>")
  ref.chat_template = template
  tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
  api = [{"role": "user", "content": "1+2"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "c", "type": "function", "function": {"name": "calc", "arguments": '{"e": "1+2"}'}}]},
         {"role": "tool", "content": "3"}]
  as_objects = [api[0], dict(api[1], content="", tool_calls=[
      {"id": "c", "type": "function", "function": {"name": "calc", "arguments": {"e": "1+2"}}}]), api[2]]
  want = ref.apply_chat_template(as_objects, tools=tools, tokenize=False, add_generation_prompt=False)
  assert want.startswith("TOOLS calc") and '{"name": "calc", "arguments": {"e": "1+2"}}' in want
  assert ours.render_chat(api, add_generation_prompt=False, tools=tools) == want


# A reasoning template written for these tests with the constructs of Qwen3's: the last user query
# found by a reverse scan into a namespace, each assistant turn's reasoning taken from
# reasoning_content or split off its content at </think>, shown only for the turns after that query,
# tool calls as <tool_call> JSON, tool results grouped into one user turn of <tool_response>s, and an
# empty <think> block in the generation prompt when thinking is off.
REASONING_TEMPLATE = """{%- set ns = namespace(last=messages|length - 1, found=false) -%}
{%- for m in messages[::-1] -%}
{%- set i = messages|length - 1 - loop.index0 -%}
{%- if not ns.found and m.role == 'user' and not (m.content is string and m.content.startswith('<tool_response>')) -%}{%- set ns.last = i -%}{%- set ns.found = true -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'user' or m.role == 'system' -%}
{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' -%}
{%- set content = m.content if m.content is string else '' -%}
{%- set reasoning = '' -%}
{%- if m.reasoning_content is string -%}{%- set reasoning = m.reasoning_content -%}
{%- elif '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{{ '<|im_start|>assistant\n' }}
{%- if loop.index0 > ns.last -%}{{ '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}{%- endif -%}
{{ content }}
{%- for c in m.tool_calls or [] -%}
{{ '\n<tool_call>\n{"name": "' + c.function.name + '", "arguments": ' }}
{%- if c.function.arguments is string -%}{{ c.function.arguments }}{%- else -%}{{ c.function.arguments | tojson }}{%- endif -%}
{{ '}\n</tool_call>' }}
{%- endfor -%}
{{ '<|im_end|>\n' }}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}
{{ '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{ '<|im_end|>\n' }}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\n\n</think>\n\n' }}{%- endif -%}
{%- endif -%}"""


def test_a_reasoning_template_renders_as_transformers_and_continues_through_tool_results(hf_dir):
  """Qwen3-style chat (its constructs, in a template of our own): the math prompt leaves the <think>
  section to the model; an agent's tool results continue the context it decoded, reasoning kept; a
  new user turn after a reasoning turn is refused by name (the template drops that reasoning)."""
  config = json.loads((hf_dir / "tokenizer_config.json").read_text())
  (hf_dir / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=REASONING_TEMPLATE)))
  ours = HFTokenizer(str(hf_dir))
  ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"),
                                             eos_token="<|im_end|>")
  ref.chat_template = REASONING_TEMPLATE
  render = lambda m, g=True, **kw: ref.apply_chat_template(m, add_generation_prompt=g, tokenize=False, **kw)  # noqa: E731
  question = [{"role": "user", "content": "what is 1+2?"}]
  assert ours.render_chat(question) == render(question) == "<|im_start|>user\nwhat is 1+2?<|im_end|>\n<|im_start|>assistant\n"
  assert render(question, enable_thinking=False).endswith("<think>\n\n</think>\n\n")  # (the control)
  assert ours.encode_prompt("what is 1+2?") == ours.encode(render(question))
  call = {"id": "c", "type": "function", "function": {"name": "calc", "arguments": '{"e": "1+2"}'}}
  turn = {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nlet me check", "tool_calls": [call]}
  history = question + [turn]
  new = [{"role": "tool", "content": "3"}, {"role": "tool", "content": "ok"}]
  as_objects = [dict(m) for m in history + new]
  as_objects[1] = dict(turn, tool_calls=[dict(call, function={"name": "calc", "arguments": {"e": "1+2"}})])
  whole = render(as_objects)
  assert "<think>\nadd them\n</think>\n\nlet me check\n<tool_call>" in whole  # after the query: kept
  assert "<tool_response>\n3\n</tool_response>\n<tool_response>\nok" in whole
  assert ours.render_chat(history + new) == whole
  delta = ours.encode_chat_continuation(history, new)
  assert ours.encode(render(as_objects[:2], False)) + delta == ours.encode(whole)
  # a new user turn: the reasoning above it is dropped from the render, so the context is not a prefix
  follow_up = [{"role": "user", "content": "be brief"}]
  assert "add them" not in render(as_objects + follow_up)
  with pytest.raises(TokenizerError, match="new user turn after an assistant turn with reasoning"):
    ours.encode_chat_continuation(history + new + [{"role": "assistant", "content": "<think>x</think>3"}],
                                  follow_up)


def test_chat_template_arguments_from_the_config_reach_the_template_and_the_identity(hf_dir):
  """data.chat_template_kwargs='{"enable_thinking": false}' gives the prompt transformers renders
  with that argument (Qwen3's non-thinking mode: an empty <think> block), a tokenizer identity of its
  own (a decode server with other arguments does not register), and bad values are refused by name."""
  from asyncrl_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tokenization import tokenizer_of  # pylint: disable=import-outside-toplevel
  config = json.loads((hf_dir / "tokenizer_config.json").read_text())
  (hf_dir / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=REASONING_TEMPLATE)))
  ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"), eos_token="<|im_end|>")
  ref.chat_template = REASONING_TEMPLATE
  question = [{"role": "user", "content": "what is 1+2?"}]
  run = config_lib.base_config()
  run.data.tokenizer_path = str(hf_dir)
  thinking = tokenizer_of(run)
  run.data.chat_template_kwargs = '{"enable_thinking": false}'
  config_lib.validate(run)
  off = tokenizer_of(run)
  want = ref.apply_chat_template(question, add_generation_prompt=True, tokenize=False, enable_thinking=False)
  assert want.endswith("<think>\n\n</think>\n\n")
  assert off.render_chat(question) == want and off.encode_prompt("what is 1+2?") == off.encode(want)
  assert thinking.render_chat(question) != want  # (the control: without the argument, thinking on)
  assert off.identity != thinking.identity
  assert HFTokenizer(str(hf_dir), template_kwargs={"enable_thinking": False}).identity == off.identity
  for value, message in (('[1]', "must be a JSON object"), ('{"tools": []}', r"names \['tools'\]"),
                         ('{oops', "not JSON")):
    run.data.chat_template_kwargs = value
    with pytest.raises(config_lib.ConfigError, match="data.chat_template_kwargs"):
      config_lib.validate(run)
    with pytest.raises(TokenizerError, match=message):
      tokenizer_of(run)
  run.data.update(tokenizer_path="", chat_template_kwargs='{"enable_thinking": false}')
  with pytest.raises(config_lib.ConfigError, match="built-in tokenizer 'builtin' has no chat template"):
    config_lib.validate(run)


def test_hf_tokenizer_errors(tmp_path, hf_dir):
  with pytest.raises(TokenizerError, match="missing tokenizer.json"):
    HFTokenizer(str(tmp_path / "empty"))
  (hf_dir / "tokenizer_config.json").write_text("{oops")
  with pytest.raises(TokenizerError, match="tokenizer_config.json: not valid JSON"):
    HFTokenizer(str(hf_dir))
  (hf_dir / "tokenizer.json").write_text("{}")
  with pytest.raises(TokenizerError, match="cannot be parsed"):
    HFTokenizer(str(hf_dir))

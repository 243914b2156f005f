"""The environment building blocks: the registry, the safe calculator, the Python tool's limits, the
latency spec and the step pool's timeouts and errors."""

import ast
import dataclasses
import threading
import time

import numpy as np
import pytest

from asyncrl_jax.envs import base, calculator, latency, pool, python_tool, tools_env


@base.register("test-echo")
class Echo:
  stop = ("</call>",)

  def __init__(self, prefix: str = ">"):
    self.prefix = prefix

  def reset(self, problem):
    return problem["question"]

  def step(self, action):
    return base.StepResult(observation=self.prefix + action, done=True, reward=1.0)


def test_the_registry_builds_by_name_and_names_what_is_wrong():
  env = base.make("test-echo", prefix="#")
  assert env.reset({"question": "q"}) == "q" and env.step("a").observation == "#a"
  with pytest.raises(ValueError, match=r"unknown environment 'nope'; registered: \[.*'test-echo'"):
    base.make("nope")
  with pytest.raises(ValueError, match="registered already"):
    base.register("test-echo")(type("Other", (), {}))

  @base.register("test-incomplete")
  class Incomplete:  # no step
    stop = ()

    def reset(self, problem):
      return ""

  with pytest.raises(TypeError, match="lacks stop, reset or step"):
    base.make("test-incomplete")


@pytest.mark.parametrize("expression,value", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("-3 ** 2", "-9"),
    ("2 ** 100", str(2 ** 100)), ("17 // 5 + 17 % 5", "5"),
    ("123456789012345678901234567890 + 987654321098765432109876543210",
     str(123456789012345678901234567890 + 987654321098765432109876543210))])
def test_the_calculator_computes_like_python_on_arithmetic(expression, value):
  assert calculator.calculate(expression) == value


@pytest.mark.parametrize("expression,why", [
    ("__import__('os').system('true')", "Call is not allowed"), ("x + 1", "Name is not allowed"),
    ("1 / 0", "division by zero"), ("9 ** 9 ** 9", "longer than 4000 digits"), ("1 +", "not an arithmetic"),
    ("(10 ** 999) ** 5", "longer than"), ("1" * 1001, "longer than 1000 characters"),
    ("[1, 2]", "List is not allowed"), ("'a' * 3", "Constant is not allowed")])
def test_the_calculator_refuses_what_is_not_arithmetic_and_names_why(expression, why):
  with pytest.raises(calculator.CalculatorError, match=why):
    calculator.calculate(expression)


HOSTILE = [("(9**999*9**999*9**999*9**999)**1000", "longer than 4000 digits"),  # 1.3-2 s before the bounds
           ("-" * 998 + "1", "parentheses and signs"),  # RecursionError before
           ("(-1)**0.5//1", "not a real number"),  # a complex number, then TypeError before
           ("1*" * 150 + "1", "nested more than 100"),
           ("2**99999999999", "longer than 4000 digits"), ("10**4000*10**4000", "longer than 4000 digits"),
           ("-(2**13000)*-(2**13000)", "longer than 4000 digits"), ("2.0**5000", "too large for a float"),
           ("10**400/10**-400", "too large for a float"), ("1e308*10", "too large for a float")]


@pytest.mark.parametrize("expression,why", HOSTILE)
def test_the_calculator_refuses_hostile_expressions_at_once_as_a_tool_error(expression, why):
  """Each is refused by its bound before any big-integer work: far under 0.1 s of CPU (the issue's
  bound; CPU time, so a loaded machine does not change it), and the episode goes on."""
  t = time.process_time()
  with pytest.raises(calculator.CalculatorError, match=why):
    calculator.calculate(expression)
  assert time.process_time() - t < 0.1
  env = tools_env.ToolEnvironment()
  env.reset({"question": "?", "answer": "1"})
  r = env.step(f"<calc>{expression}</calc>")
  assert not r.done and r.info["error"] and r.observation.startswith("<result>error: ")


@pytest.mark.parametrize("expression,value", [
    ("2**13000", str(2**13000)), ("7**4700", str(7**4700)), ("(-1)**99999999999", "-1"),
    ("0**99999999999", "0"), ("2**-3", "0.125"), ("(2**13000)%7", str(2**13000 % 7))])
def test_the_calculators_bounds_keep_what_fits(expression, value):
  """Negative control for the bounds: results just inside them are computed exactly."""
  assert calculator.calculate(expression) == value


def test_the_python_tool_runs_code_and_reports_its_output():
  r = python_tool.run_python("import os; print(sum(range(10))); print(sorted(os.environ))")
  assert r.exit_code == 0 and not r.timed_out and not r.truncated
  total, names = r.stdout.splitlines()
  assert total == "45"
  # no inherited environment: the sandbox's own PATH, HOME and LANG (and PWD, set by bubblewrap)
  assert set(ast.literal_eval(names)) <= {"PATH", "HOME", "LANG", "PWD", "LC_CTYPE"} and "PATH" in names
  assert r.sandboxed


def test_the_python_tool_enforces_its_limits():
  limits = python_tool.Limits(seconds=2.0, cpu_seconds=1, memory_bytes=256 << 20, output_bytes=1000)
  t = time.perf_counter()
  slept = python_tool.run_python("import time; time.sleep(30)", limits)
  assert slept.timed_out and slept.exit_code is None and time.perf_counter() - t < 10
  # CPU limit: SIGXCPU (a wall clock long enough that a loaded machine still gives it its CPU second)
  spun = python_tool.run_python("while True: pass", dataclasses.replace(limits, seconds=60.0))
  assert spun.exit_code is not None and spun.exit_code != 0 and not spun.timed_out
  big = python_tool.run_python("x = bytearray(512 << 20)", limits)
  assert big.exit_code != 0 and "MemoryError" in big.stderr
  loud = python_tool.run_python("print('x' * 100000)", limits)
  assert loud.truncated and len(loud.stdout) <= 1000
  failed = python_tool.run_python("raise SystemExit(3)", limits)
  assert failed.exit_code == 3 and not failed.timed_out
  with pytest.raises(ValueError, match="seconds=0"):
    python_tool.Limits(seconds=0)


def test_latency_specs_draw_their_distribution():
  lat = latency.Latency.parse("lognormal:median=0.2,sigma=1.15")
  assert (lat.median, lat.sigma, lat.cap) == (0.2, 1.15, 60.0) and latency.Latency.parse("") is None
  draws = [lat.draw(np.random.default_rng(i)) for i in range(4000)]
  assert 0.18 < np.median(draws) < 0.22 and max(draws) <= 60.0
  assert latency.Latency.parse("lognormal:median=1,sigma=0,cap=0.5").draw(np.random.default_rng(0)) == 0.5
  for bad, what in [("lognormal:median=0.2", "missing sigma"), ("normal:median=1,sigma=1", "kind"),
                    ("lognormal:median=1,sigma=1,mean=2", "is not median=, sigma= or cap="),
                    ("lognormal:median=-1,sigma=1", "median=-1")]:
    with pytest.raises(ValueError, match=what):
      latency.Latency.parse(bad)


def _collect(p, step, n=1, timeout=10.0):
  got, done = [], threading.Event()

  def on_done(outcome):
    got.append(outcome)
    if len(got) == n:
      done.set()

  for _ in range(n):
    p.submit(step, on_done)
  assert done.wait(timeout)
  return got


def test_the_pool_reports_each_step_once_with_errors_and_timeouts_as_finish_reasons():
  p = pool.EnvironmentPool(workers=4, timeout=0.5)
  try:
    ok = _collect(p, lambda: base.StepResult("obs", reward=1.0))[0]
    assert ok.result.observation == "obs" and ok.finish_reason == ""
    err = _collect(p, lambda: 1 / 0)[0]
    assert err.result is None and err.finish_reason == pool.ENV_ERROR and "ZeroDivisionError" in err.error
    wrong = _collect(p, lambda: "text")[0]
    assert wrong.finish_reason == pool.ENV_ERROR and "not a StepResult" in wrong.error
    release = threading.Event()
    slow = _collect(p, lambda: release.wait(5) and base.StepResult("late"))
    assert slow[0].finish_reason == pool.ENV_TIMEOUT and 0.45 < slow[0].seconds < 2 and p.stuck == 1
    release.set()
    time.sleep(0.2)
    assert len(slow) == 1 and p.stuck == 0  # the late answer is dropped, never reported twice
    # a slow step holds up none of the others
    t = time.perf_counter()
    outcomes = _collect(p, lambda: (time.sleep(0.05), base.StepResult("x"))[1], n=8)
    assert all(o.finish_reason == "" for o in outcomes) and time.perf_counter() - t < 1.0
  finally:
    p.close()


def test_closing_the_pool_waits_for_the_calls_still_running_up_to_its_bound():
  p = pool.EnvironmentPool(workers=2, timeout=5.0)
  finished = []
  p.submit(lambda: (time.sleep(0.3), finished.append("close"))[0], lambda o: None, expect=None)
  assert p.close() == 0 and finished == ["close"]  # waited for it: an environment's close ran
  with pytest.raises(RuntimeError):
    p.submit(lambda: None, lambda o: None, expect=None)  # a closed pool takes no more work
  stuck = pool.EnvironmentPool(workers=1, timeout=5.0)
  release = threading.Event()
  stuck.submit(lambda: release.wait(10), lambda o: None, expect=None)
  t = time.perf_counter()
  assert stuck.close(wait=0.2) == 1 and time.perf_counter() - t < 2  # bounded: reports it, returns
  release.set()


def test_the_tool_environment_answers_calls_and_scores_the_final_answer():
  env = base.make("tools")
  assert env.reset({"question": "123456789+987654321=", "answer": "1111111110"}) == "123456789+987654321="
  call = env.step("<calc>123456789+987654321</calc>")
  assert call.observation == "<result>1111111110</result>" and not call.done and call.reward == 0
  assert call.info == {"tool": "calculator", "latency": 0.0}
  bad = env.step("<calc>12+</calc>")
  assert bad.observation.startswith("<result>error: not an arithmetic") and "error" in bad.info
  assert env.step("so the sum is #1111111110").reward == 1.0
  assert env.step("#1111111111").reward == 0.0  # (negative control: a wrong answer scores 0)
  limited = base.make("tools", max_calls=1)
  limited.reset({"question": "q", "answer": "3"})
  assert not limited.step("<calc>1+2</calc>").done
  ended = limited.step("<calc>1+2</calc>")
  assert ended.done and ended.reward == 0 and ended.info == {"ended": "max_calls"}
  with pytest.raises(ValueError, match="tool 'shell'"):
    base.make("tools", tool="shell")


def test_the_python_tool_environment_returns_stdout_or_the_error_and_waits_its_latency():
  env = base.make("tools", tool="python", call_open="<python>", call_close="</python>",
                  latency="lognormal:median=0.05,sigma=0")
  env.reset({"question": "q", "answer": "6"})
  t = time.perf_counter()
  out = env.step("<python>print(1 + 2 + 3)</python>")
  assert out.observation == "<result>6</result>" and out.info["latency"] == pytest.approx(0.05)
  assert time.perf_counter() - t >= 0.05
  err = env.step("<python>1 / 0</python>")
  assert err.observation == "<result>error: ZeroDivisionError: division by zero</result>"
  assert out.info["sandboxed"] is True and err.info["sandboxed"] is True  # (each turn's call, recorded)


def test_an_unsandboxed_python_call_is_recorded_in_the_turn(monkeypatch):
  from asyncrl_jax.envs import sandbox  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(sandbox, "available", lambda python="": (False, "no user namespaces (test)"))
  env = base.make("tools", tool="python", call_open="<python>", call_close="</python>", allow_unsandboxed=True)
  env.reset({"question": "q", "answer": "6"})
  out = env.step("<python>print(6)</python>")
  assert out.observation == "<result>6</result>" and out.info["sandboxed"] is False
  calc = base.make("tools")
  calc.reset({"question": "q", "answer": "3"})
  assert "sandboxed" not in calc.step("<calc>1+2</calc>").info  # (no model code ran)


def test_tool_latency_is_drawn_per_episode():
  """Each episode draws its own latencies (a group's members wait independent times), reproducibly."""
  def first_wait(episode_id):
    env = base.make("tools", latency="lognormal:median=0.001,sigma=1.0", episode_id=episode_id)
    env.reset({"question": "1+1=", "answer": "2"})
    return env.step("<calc>1+1</calc>").info["latency"]
  waits = [first_wait(f"p0-s{j}") for j in range(4)]
  assert len(set(waits)) == 4 and first_wait("p0-s1") == waits[1]


def test_the_constant_output_control_answers_every_call_with_its_text():
  env = tools_env.ToolEnvironment(constant_output="")
  env.reset({"question": "12+30=", "answer": "42"})
  call = env.step("<calc>12+30</calc>")
  assert call.observation == "<result></result>" and not call.done and call.info["tool"] == "calculator"
  assert env.calls == 1  # a call all the same (counted, limited by max_calls)
  real = tools_env.ToolEnvironment()
  real.reset({"question": "12+30=", "answer": "42"})
  assert real.step("<calc>12+30</calc>").observation == "<result>42</result>"  # negative control


# Qwen2.5's handling of tool calls and tool messages, cut down to what the test needs
HERMES_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content }}{%- for c in m.tool_calls or [] %}"
    "{{- '\n<tool_call>\n' }}{{- c.function | tojson }}{{- '\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def test_the_chat_format_gives_the_tokens_an_agent_with_a_function_tool_gets(tmp_path):
  """``format="chat"``: on the built-in vocabulary the same tokens as the marker format (one task
  trains both ways); on a Hugging Face tokenizer, Hermes ``<tool_call>`` blocks answered by the chat
  template's rendering of a tool message."""
  import json  # pylint: disable=import-outside-toplevel
  from tests.fixtures.hf_models import make_bpe_tokenizer  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.data import tool_arithmetic  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tokenization import HFTokenizer, ToolTokenizer  # pylint: disable=import-outside-toplevel
  problem = {"question": "7+5=", "answer": "12"}
  builtin = ToolTokenizer()
  markers = tools_env.ToolEnvironment(**tool_arithmetic.ENV_OPTIONS)
  chat = tools_env.ToolEnvironment(format="chat", tokenizer=builtin, error_output="")
  for env in (markers, chat):
    env.reset(problem)
  assert chat.stop == markers.stop == ("]",)
  for action in ("3+4=7;[7+5]", "[99+1]", "[1+]"):
    want = markers.step(action).observation
    got = chat.step(action)
    assert got.observation == builtin.encode(want) and got.info["tool"] == "calculator", action
  assert chat.step("#12").reward == 1.0 and chat.step("#12").done
  # a Hugging Face tokenizer with Hermes tool calls
  make_bpe_tokenizer(tmp_path, ["tool_call tool_response expression calculator name arguments 0123456789"])
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=HERMES_TEMPLATE)))
  hf = HFTokenizer(str(tmp_path))
  env = tools_env.ToolEnvironment(format="chat", tokenizer=hf)
  env.reset(problem)
  assert env.stop == ()  # (the end of sequence ends a message)
  call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7+5"}}\n</tool_call>'
  out = env.step("Adding.\n" + call)
  want = "<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
  assert out.observation == hf.encode(want) and not out.done
  wrong = env.step('<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>')
  assert "no tool 'search'" in wrong.info["error"]
  assert hf.decode(wrong.observation).count("error: no tool 'search'") == 1
  assert env.step("The sum is #12").reward == 1.0
  with pytest.raises(ValueError, match="needs the decode server's tokenizer"):
    tools_env.ToolEnvironment(format="chat")

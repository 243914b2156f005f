"""Running a model-written program on a problem's tests, in the sandbox, without letting it see or
fake the expected outputs (the code reward's machinery: ``rl.rewards.code_reward``).

Two forms of tests (``parse_tests``), as LiveCodeBench and DeepCoder write them:

* ``{"stdin": [{"input": str, "output": str}, ...]}``: the program reads ``input`` on stdin; its
  stdout must equal ``output`` line by line, trailing whitespace (and trailing blank lines) ignored;
* ``{"fn_name": str, "cases": [{"args": [...], "output": value}, ...]}``: the program defines the
  function (or a ``class Solution`` with that method; ``typing``'s names are in scope, as LeetCode's
  starter code expects); it is called with the JSON ``args``, its return value serialised to JSON by
  the harness and compared, as JSON values, with ``output``.

and a third, for HumanEval-style problems whose tests are code:

* ``{"check": str, "entry_point": str, "prompt": str}``: the program (after ``prompt``, the
  function's signature and docstring, when it does not define ``entry_point`` itself) and then
  ``check`` run in one process, and ``check(entry_point)`` must return. These tests are code, so they
  are inside the sandbox beside the program: fit for evaluation, not a reward to train against.

One sandbox start (``envs.sandbox``) runs every test of a program: a harness inside it compiles the
program and runs it once per test in a process forked from itself (a fresh copy each test, without an
interpreter start), in a session of its own, under the per-test wall clock and CPU limit
(``CodeLimits``), reporting each run's status and output on its stdout; the
host compares each report with the expected output as it arrives and, unless ``partial``, ends the
sandbox at the first failing test. So:

* the expected outputs never enter the sandbox (not in the harness, its files, arguments or
  environment): a program can only produce them by computing them;
* a test passes only on a report the harness wrote after the run ended normally: an early
  ``sys.exit(0)`` or ``os._exit(0)`` leaves stdout short (stdin form) or no return value (function
  form) and fails, as does a non-zero exit, a timeout or output past the cap;
* a return value is compared as the JSON the harness wrote of it, on the host: an object whose
  ``__eq__`` claims equality with everything is not JSON (a failure), and a subclass of a JSON type
  is written as its plain value;
* output is bounded (per test and in all) and nothing the program started outlives the call (the
  sandbox's PID namespace ends with it).

What it does not stop: a program that computes the answers (that is the point), nor one that reads
the inputs of the tests after its own (they are all in the sandbox: only the outputs are hidden).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Optional

from asyncrl_jax.envs import sandbox

MARK = "\x1e"  # starts each report line of the harness (a record separator no test output needs)


class CodeTestError(ValueError):
  """Malformed tests (the message names the field and the problem)."""


@dataclasses.dataclass(frozen=True)
class CodeTests:
  """A problem's tests: ``mode`` "stdin" (``inputs`` strings) or "fn" (``inputs`` argument lists,
  ``fn_name``); ``expected`` the outputs (strings, or JSON values)."""
  mode: str
  inputs: tuple
  expected: tuple
  fn_name: str = ""
  check: str = ""  # (mode "check": the test code, and the prompt the program completes)
  prompt: str = ""
  public: int = 0  # the first this many tests are public (the tests' "public")

  def __len__(self) -> int:
    return len(self.inputs)


@dataclasses.dataclass(frozen=True)
class CodeLimits:
  """Per test: ``seconds`` of wall clock and ``cpu_seconds`` of CPU; per process ``memory_bytes``
  of address space; per test ``output_bytes`` of stdout kept (more is a failure)."""
  seconds: float = 6.0
  cpu_seconds: int = 4
  memory_bytes: int = 1 << 30
  output_bytes: int = 1 << 16

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if not getattr(self, field.name) > 0:
        raise ValueError(f"code test limit {field.name}={getattr(self, field.name)!r} must be > 0")


@dataclasses.dataclass(frozen=True)
class CodeResult:
  """What a run found: per test run ``statuses`` ("pass", "wrong", "error", "timeout" (its wall
  clock or CPU limit), "too_much_output", "no_result"; tests not run are left out), the tests ``passed`` of ``total``,
  the seconds, and whether it ran sandboxed."""
  passed: int
  total: int
  statuses: tuple
  seconds: float
  sandboxed: bool = True
  outputs: tuple = ()  # per test run: what it printed (stdin form) or returned (its JSON)

  @property
  def all_passed(self) -> bool:
    return self.total > 0 and self.passed == self.total


def _check(ok: bool, message: str) -> None:
  if not ok:
    raise CodeTestError(message)


def parse_tests(tests: Any) -> CodeTests:
  """``tests`` (a dict, or its JSON text) as ``CodeTests``; ``CodeTestError`` names what is wrong."""
  if isinstance(tests, (str, bytes)):
    try:
      tests = json.loads(tests)
    except json.JSONDecodeError as e:
      raise CodeTestError(f"tests are not valid JSON ({e})") from None
  _check(isinstance(tests, dict), f"tests must be an object with 'stdin' or 'fn_name', got {type(tests).__name__}")
  if "stdin" in tests:
    cases = tests["stdin"]
    _check(isinstance(cases, list) and cases, "tests.stdin must be a non-empty list of {input, output}")
    for i, c in enumerate(cases):
      _check(isinstance(c, dict) and isinstance(c.get("input"), str) and isinstance(c.get("output"), str),
             f"tests.stdin[{i}] must be {{'input': str, 'output': str}}, got {str(c)[:80]}")
    return CodeTests("stdin", tuple(c["input"] for c in cases), tuple(c["output"] for c in cases),
                     public=int(tests.get("public", 0)))
  if "fn_name" in tests:
    name, cases = tests["fn_name"], tests.get("cases")
    _check(isinstance(name, str) and name.isidentifier(), f"tests.fn_name={name!r} must be a Python identifier")
    _check(isinstance(cases, list) and cases, "tests.cases must be a non-empty list of {args, output}")
    for i, c in enumerate(cases):
      _check(isinstance(c, dict) and isinstance(c.get("args"), list) and "output" in c,
             f"tests.cases[{i}] must be {{'args': [...], 'output': value}}, got {str(c)[:80]}")
    return CodeTests("fn", tuple(c["args"] for c in cases), tuple(c["output"] for c in cases), name,
                     public=int(tests.get("public", 0)))
  if "check" in tests:
    for key in ("check", "entry_point"):
      _check(isinstance(tests.get(key), str) and tests[key].strip(), f"tests.{key} must be a non-empty string")
    _check(tests["entry_point"].isidentifier(), f"tests.entry_point={tests['entry_point']!r} must be a Python identifier")
    return CodeTests("check", (None,), (True,), tests["entry_point"], tests["check"], str(tests.get("prompt", "")))
  raise CodeTestError(f"tests have neither 'stdin', 'fn_name' nor 'check' (keys: {sorted(tests)[:5]})")


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)


def extract_program(completion: str) -> Optional[str]:
  """The completion's last fenced block tagged python (``python``, ``py``, ``python3``), else its last
  untagged fenced block; None when it has neither."""
  blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(completion)]
  for wanted in (("python", "py", "python3"), ("",)):
    found = [body for tag, body in blocks if tag in wanted]
    if found:
      return found[-1]
  return None


# Runs inside the sandbox. The program runs once per test in a process forked from this harness
# (no interpreter start per test), in a session of its own, under the per-test CPU and output-file
# limits; its reports go to the harness's stdout, one line each: MARK + JSON {"i", "status", "out"}.
# Nothing expected is here.
_HARNESS = r'''
import io, json, os, resource, signal, sys, time
SPEC = json.loads(%(spec)r)
MARK = "\x1e"
cap = SPEC["output_bytes"]
code = compile(SPEC["program"], "solution.py", "exec")


def child(i, given):
    os.setsid()
    resource.setrlimit(resource.RLIMIT_CPU, (SPEC["cpu_seconds"], SPEC["cpu_seconds"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cap + 1, cap + 1))  # its stdout file: a byte past the cap
    with open("input", "w", encoding="utf-8") as f:
        f.write(given if SPEC["mode"] == "stdin" else "")
    fd = os.open("input", os.O_RDONLY)
    os.dup2(fd, 0)
    out = os.open("stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    result = os.open("result", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8")
    status = 0
    try:
        scope = {"__name__": "__main__", "__builtins__": __builtins__}
        if SPEC["mode"] == "fn":  # (LeetCode-style starter code names typing's List, Optional...)
            scope["__name__"] = "solution"
            exec("from typing import *", scope)
        exec(code, scope)
        if SPEC["mode"] == "check":
            exec(compile(SPEC["check"], "check.py", "exec"), scope)
            scope["check"](scope[SPEC["fn_name"]])
            os.write(result, b"\x1dtrue")
        elif SPEC["mode"] == "fn":
            fn = scope.get(SPEC["fn_name"])
            if fn is None and "Solution" in scope:
                fn = getattr(scope["Solution"](), SPEC["fn_name"])
            value = json.dumps(fn(*given))
            os.write(result, ("\x1d" + value).encode())
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        status = 1
    try:
        sys.stdout.flush()
    except BaseException:
        status = status or 1
    os._exit(status)


for i, given in enumerate(SPEC["inputs"]):
    pid = os.fork()
    if pid == 0:
        try:
            child(i, given)
        finally:
            os._exit(1)
    deadline = time.monotonic() + SPEC["seconds"]
    status = None
    while status is None:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            code_ = os.waitstatus_to_exitcode(raw)
            cpu_limit = code_ in (-signal.SIGXCPU, -signal.SIGKILL)  # (its CPU limit's signals)
            status = "ran" if code_ == 0 else "timeout" if cpu_limit else "error"
        elif time.monotonic() > deadline:
            status = "timeout"
        else:
            time.sleep(0.001)
    try:
        os.killpg(pid, signal.SIGKILL)  # what it started in its session
    except OSError:
        pass
    if status == "timeout":
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    name = "stdout" if SPEC["mode"] == "stdin" else "result"
    try:
        with open(name, "rb") as f:
            out = f.read(cap + 1)
    except OSError:
        out = b""
    if len(out) > cap:
        out, status = b"", "too_much_output"
    if SPEC["mode"] != "stdin" and status == "ran" and not out.startswith(b"\x1d"):
        status = "no_result"
    line = json.dumps({"i": i, "status": status, "out": out.decode("utf-8", "replace")}, ensure_ascii=False)
    sys.stdout.write(MARK + line + "\n")
    sys.stdout.flush()
    for leftover in ("stdout", "result", "input"):
        try:
            os.unlink(leftover)
        except OSError:
            pass
'''


def _same_lines(got: str, want: str) -> bool:
  norm = lambda text: [line.rstrip() for line in text.rstrip().splitlines()]  # noqa: E731
  return norm(got) == norm(want)


def _verdict(tests: CodeTests, report: dict) -> str:
  i, status = report["i"], report["status"]
  if status != "ran":
    return status
  out = report["out"]
  if tests.mode == "stdin":
    return "pass" if _same_lines(out, tests.expected[i]) else "wrong"
  if not out.startswith("\x1d"):
    return "no_result"  # it exited (sys.exit, os._exit) before returning
  if tests.mode == "check":
    return "pass" if out == "\x1dtrue" else "no_result"
  try:
    value = json.loads(out[1:])
  except json.JSONDecodeError:
    return "no_result"
  return "pass" if json_equal(value, tests.expected[i]) else "wrong"


def json_equal(a, b) -> bool:
  """Equality of two JSON values: numbers by value (1 == 1.0), booleans only with booleans, lists
  element by element, objects key by key."""
  if isinstance(a, bool) or isinstance(b, bool):
    return isinstance(a, bool) and isinstance(b, bool) and a == b
  if isinstance(a, (int, float)) and isinstance(b, (int, float)):
    return a == b
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
  return type(a) is type(b) and a == b


def _reports(stdout: str) -> list:
  out = []
  for line in stdout.split("\n"):
    if line.startswith(MARK):
      try:
        out.append(json.loads(line[1:]))
      except json.JSONDecodeError:
        break  # (a line cut at the output cap: the run was killed there)
  return out


def run_tests(program: str, tests: CodeTests, limits: CodeLimits = CodeLimits(), *,
              partial: bool = False, python: str = "") -> CodeResult:
  """Runs ``program`` on every test in one sandbox start (see the module docstring); unless
  ``partial``, stops at the first failing test. Raises ``sandbox.SandboxUnavailable`` where the
  sandbox cannot run."""
  if tests.mode == "check" and not re.search(rf"^\s*def {tests.fn_name}\b", program, re.M):
    program = tests.prompt + program  # (a completion of the prompt's function body)
  spec = json.dumps({"program": program, "mode": tests.mode, "inputs": list(tests.inputs),
                     "fn_name": tests.fn_name, "check": tests.check, "seconds": limits.seconds,
                     "cpu_seconds": limits.cpu_seconds, "output_bytes": limits.output_bytes})
  n = len(tests)
  box = sandbox.Limits(seconds=n * (limits.seconds + 1.0) + 10.0, cpu_seconds=n * limits.cpu_seconds + 10,
                       memory_bytes=limits.memory_bytes, output_bytes=n * (2 * limits.output_bytes + 256) + 1024,
                       processes=16, disk_bytes=max(16 << 20, 4 * len(program)))
  verdicts: list = []
  outputs: list = []

  def failed_yet(stdout: str) -> bool:
    for report in _reports(stdout)[len(verdicts):]:
      verdicts.append(_verdict(tests, report))
      outputs.append(report["out"].lstrip("\x1d"))
    return not partial and any(v != "pass" for v in verdicts)

  result = sandbox.run(_HARNESS % {"spec": spec}, box, python, stop_when=failed_yet)
  failed_yet(result.stdout)  # (reports that arrived after the last look)
  if not partial and verdicts:
    first = next((k for k, v in enumerate(verdicts) if v != "pass"), len(verdicts))
    del verdicts[first + 1:]  # (reports written before the kill landed, after the first failure)
    del outputs[first + 1:]
  return CodeResult(sum(v == "pass" for v in verdicts), n, tuple(verdicts), result.seconds, result.sandboxed,
                    tuple(outputs))

"""The code reward against honest and hostile programs: honest ones score 1 in both test forms; each
hostile one (early exits, an always-equal return value, hunting for the expected outputs, endless
loops, output floods, memory grabs, processes left behind) scores 0 within its limits with nothing
left running; the expected outputs never reach the sandbox."""

import json
import os
import time
import uuid

import pytest

from asyncrl_jax.envs import code_tests, sandbox
from asyncrl_jax.rl.rewards import code_reward

SUM = {"stdin": [{"input": "1 2\n", "output": "3\n"}, {"input": "40 2\n", "output": "42"},
                 {"input": "-5 5\n", "output": "0  \n\n"}]}  # (trailing whitespace and blank lines ignored)
ADD = {"fn_name": "add", "cases": [{"args": [1, 2], "output": 3}, {"args": [[1], [2, 3]], "output": [1, 2, 3]},
                                   {"args": ["a", "b"], "output": "ab"}]}
FAST = code_tests.CodeLimits(seconds=2.0, cpu_seconds=1)


@pytest.fixture(scope="module", autouse=True)
def _sandbox():
  ok, why = sandbox.available()
  assert ok, f"the sandbox must run on this machine (it does on CI's): {why}"


def fenced(program: str, prose: str = "Here is my solution.") -> str:
  return f"{prose}\n```python\n{program}\n```\n"


def test_honest_programs_score_one_in_both_forms():
  stdin = "a, b = map(int, input().split())\nprint(a + b)"
  assert code_reward(fenced(stdin), SUM) == 1.0
  assert code_reward(fenced("def add(a, b):\n    return a + b"), json.dumps(ADD)) == 1.0
  assert code_reward(fenced("class Solution:\n    def add(self, a, b):\n        return a + b"), ADD) == 1.0
  # the last python block is the program (an earlier one, or a block of another language, is not)
  text = fenced("print('draft')") + "```text\nnot code\n```\n" + fenced(stdin, "Final:")
  assert code_reward(text, SUM) == 1.0
  assert code_reward("no code at all", SUM) == 0.0
  # the control: a wrong program fails, and partial credit counts the tests passed
  wrong = "a, b = map(int, input().split())\nprint(a + b if a > 0 else 7)"
  assert code_reward(fenced(wrong), SUM) == 0.0
  assert code_reward(fenced(wrong), SUM, partial=True) == pytest.approx(2 / 3)


@pytest.mark.parametrize("program,form", [
    ("import sys\nsys.exit(0)", "stdin"),
    ("import os\nos._exit(0)", "stdin"),
    ("import sys\ndef add(a, b):\n    sys.exit(0)", "fn"),
    ("import os\ndef add(a, b):\n    os._exit(0)", "fn"),
    ("import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b", "fn"),
    # a return value that claims equality with everything: not JSON, so no result
    ("class Any:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Any()", "fn"),
    # a subclass of a JSON type is written as its plain value, whatever its __eq__ says
    ("class Int(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
     "def add(a, b):\n    return Int(0)", "fn"),
    # writing the report line the harness would write, claiming a pass
    ("import sys\nsys.stdout.write('\\x1e' + '{\"i\": 0, \"status\": \"ran\", \"out\": \"3\"}\\n')", "stdin"),
])
def test_hostile_programs_score_zero(program, form):
  tests = SUM if form == "stdin" else ADD
  assert code_reward(fenced(program), tests, limits=FAST) == 0.0
  assert code_reward(fenced(program), tests, limits=FAST, partial=True) == 0.0


def test_the_expected_outputs_never_enter_the_sandbox(monkeypatch):
  secret = f"expected-{uuid.uuid4().hex}"
  tests = {"stdin": [{"input": "x\n", "output": secret}]}
  seen = []
  real = sandbox.run
  monkeypatch.setattr(sandbox, "run", lambda code, *a, **k: seen.append(code) or real(code, *a, **k))
  # a program hunting for it everywhere it can look: files, its own and every process's
  # command line and environment, then printing whatever looks like it
  hunter = """
import os, re
pattern = re.compile(rb"expected-[0-9a-f]{32}")
found = set()
for root, dirs, files in os.walk("/", onerror=lambda e: None):
    if root.startswith(("/proc", "/sys", "/dev", "/usr", "/lib")):  # (the system's own files)
        dirs[:] = []
        continue
    for name in files:
        try:
            with open(os.path.join(root, name), "rb") as f:
                data = f.read(1 << 20)
        except OSError:
            continue
        found.update(m.decode() for m in pattern.findall(data))
for pid in filter(str.isdigit, os.listdir("/proc")):
    for what in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{what}", "rb") as f:
                data = f.read()
        except OSError:
            continue
        found.update(m.decode() for m in pattern.findall(data))
print(sorted(found)[0] if found else "nothing")
"""
  result = code_tests.run_tests(hunter, code_tests.parse_tests(tests), code_tests.CodeLimits(seconds=20, cpu_seconds=15))
  assert result.statuses == ("wrong",)
  assert len(seen) == 1 and secret not in seen[0]
  # the control: the same hunter finds a value that is there (the input, which the sandbox holds)
  tests = {"stdin": [{"input": secret + "\n", "output": secret}]}
  assert code_tests.run_tests(hunter, code_tests.parse_tests(tests),
                              code_tests.CodeLimits(seconds=20, cpu_seconds=15)).statuses == ("pass",)


def _host_processes_with(marker: str) -> list:
  out = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if marker.encode() in f.read():
          out.append(pid)
    except OSError:
      pass
  return out


def test_limits_hold_and_nothing_outlives_the_call():
  marker = f"left-behind-{uuid.uuid4().hex}"
  cases = {
      "while True:\n    pass": "timeout",  # the CPU limit ends it (or the wall clock)
      "import time\ntime.sleep(60)": "timeout",  # the wall clock ends it
      "while True:\n    print('x' * 4096)": "too_much_output",
      "x = bytearray(4 << 30)": "error",  # past the address-space limit
      # a detached process that would outlive the test, and the program exits at once
      (f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', "
       f"'{marker}'], start_new_session=True)\n"): "wrong",
  }
  for program, status in cases.items():
    t = time.perf_counter()
    result = code_tests.run_tests(program, code_tests.parse_tests(SUM), FAST)
    assert result.statuses == (status,), program
    assert time.perf_counter() - t < 10.0, program  # within its limits (one test: the first failed)
  left = _host_processes_with(marker)
  assert left == [], [open(f"/proc/{pid}/cmdline", "rb").read() for pid in left]


def test_scoring_stops_at_the_first_failing_test_unless_partial():
  tests = {"stdin": [{"input": "1\n", "output": "no"}] + [{"input": "2\n", "output": "2"}] * 3}
  slow_echo = "import time\nv = input()\ntime.sleep(0.3 if v == '2' else 0)\nprint(v)"
  stopped = code_tests.run_tests(slow_echo, code_tests.parse_tests(tests), FAST)
  assert stopped.statuses == ("wrong",) and stopped.passed == 0 and stopped.total == 4
  every = code_tests.run_tests(slow_echo, code_tests.parse_tests(tests), FAST, partial=True)
  assert every.statuses == ("wrong", "pass", "pass", "pass") and every.passed == 3
  assert stopped.seconds < every.seconds


def test_malformed_tests_are_refused_by_name():
  for tests, message in [
      ("{oops", "tests are not valid JSON"),
      ([], "tests must be an object"),
      ({"stdin": []}, "tests.stdin must be a non-empty list"),
      ({"stdin": [{"input": 1, "output": "1"}]}, r"tests.stdin\[0\] must be"),
      ({"fn_name": "not valid", "cases": [{"args": [], "output": 1}]}, "must be a Python identifier"),
      ({"fn_name": "f", "cases": [{"args": 3, "output": 1}]}, r"tests.cases\[0\] must be"),
      ({"inputs": []}, "neither 'stdin', 'fn_name' nor 'check'"),
      ({"check": "def check(f): pass", "entry_point": "no such"}, "must be a Python identifier")]:
    with pytest.raises(code_tests.CodeTestError, match=message):
      code_reward(fenced("print(1)"), tests)


def test_json_values_compare_as_json():
  eq = code_tests.json_equal
  assert eq(1, 1.0) and eq([1, {"a": [True]}], [1.0, {"a": [True]}])
  assert not eq(True, 1) and not eq([1, 2], [2, 1]) and not eq({"a": 1}, {"a": 1, "b": 2}) and not eq("1", 1)


def test_a_repeat_of_a_running_program_does_not_hold_a_reward_thread(monkeypatch):
  """Two reward threads; a program whose run is held open, three repeats of it, then another program:
  with CodeReward the repeats are called back when the run ends, so the other program is scored on
  the second thread while the first run is still open; every repeat gets the run's score and the
  program runs once. The control: a reward without ``in_flight`` (the same cache, called plainly)
  parks the second thread on the repeat, and the other program waits for the held run."""
  import threading  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.rl import rewards  # pylint: disable=import-outside-toplevel
  held = "```python\nprint(1)\n```"

  def run(release):
    def fake(completion, tests, limits=None):
      if completion == held:
        assert release.wait(30)
      return 1.0 if completion == held else 0.5
    return fake

  for callbacks in (True, False):
    release, got, lock = threading.Event(), {}, threading.Lock()
    monkeypatch.setattr(rewards, "code_reward", run(release))
    reward = rewards.CodeReward()
    fn = reward if callbacks else (lambda c, t: reward(c, t))
    other_done = threading.Event()

    def done(item, r):
      with lock:
        got[item] = r
      if item == "other":
        other_done.set()

    worker = rewards.RewardWorker(fn, done, threads=2)
    for i in range(4):
      worker.submit(f"held{i}", held, '{"stdin": []}')
      time.sleep(0.05)  # (the first run starts before its repeats arrive)
    worker.submit("other", "```python\nprint(2)\n```", '{"stdin": []}')
    assert other_done.wait(5) == callbacks  # scored while the held run is open only with callbacks
    release.set()
    worker.close()
    assert got == {"held0": 1.0, "held1": 1.0, "held2": 1.0, "held3": 1.0, "other": 0.5}
    assert reward.runs == 2 and reward.calls == 5

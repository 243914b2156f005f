"""CPU-bound tools in worker processes: the calculator gives the same answers and errors there, a
tool that computes does not stall the server's other threads (it does in-process: the negative
control), a tool that runs over its time is killed and the next call works."""

import os
import threading
import time

import pytest

from asyncrl_jax.envs import calculator, tools_env, worker

SPIN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "spin_tool.py")
EXPRESSIONS = ["1+2", "12*34-5", "(7+8)*(9-3)", "2**10", "1/0", "9**999*9**999*9**999*9**999",
               "(9**999*9**999*9**999*9**999)**1000", "-" * 998 + "1", "(-1)**0.5//1", "import os", ""]


def _in_process(text):
  try:
    return ("result", calculator.calculate(text))
  except calculator.CalculatorError as e:
    return ("error", str(e))


def test_the_calculator_answers_and_fails_alike_in_its_worker():
  w = tools_env.calculator_workers()
  for text in EXPRESSIONS:
    try:
      got = ("result", w.call(text))
    except worker.ToolError as e:
      got = ("error", str(e))
    assert got == _in_process(text), text
  assert any(_in_process(t)[0] == "error" for t in EXPRESSIONS)  # (the errors were exercised)


def _longest_gap(work) -> float:
  """The longest pause of a ticking thread (every 5 ms) while ``work()`` runs in this thread."""
  stop, ticks = threading.Event(), []

  def tick():
    while not stop.is_set():
      ticks.append(time.perf_counter())
      time.sleep(0.005)

  t = threading.Thread(target=tick)
  t.start()
  time.sleep(0.05)
  work()
  time.sleep(0.05)
  stop.set()
  t.join()
  return max(b - a for a, b in zip(ticks, ticks[1:]))


def test_a_computing_tool_in_a_worker_does_not_stall_other_threads():
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("spin_tool", SPIN)
  spin = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(spin)
  w = worker.ToolWorkers(SPIN, "power", workers=1, timeout=60)
  w.call("10")  # (started)
  in_worker = _longest_gap(lambda: w.call("4000000"))
  in_process = _longest_gap(lambda: spin.power("4000000"))  # the negative control: the GIL is held
  w.close()
  assert in_process > 0.1, in_process
  assert in_worker < in_process / 3, (in_worker, in_process)


def test_a_tool_over_its_time_is_killed_and_the_next_call_works():
  w = worker.ToolWorkers(SPIN, "power", workers=1, timeout=0.3)
  first = w.call("10")
  (p,) = w._idle  # pylint: disable=protected-access
  with pytest.raises(TimeoutError, match="longer than 0.3s"):
    w.call("100000000")
  assert p.poll() is not None  # the worker that ran over is gone
  assert w.call("10") == first == str((3 ** 10).bit_length())
  (q,) = w._idle  # pylint: disable=protected-access
  w.close()
  assert q.poll() is not None
  with pytest.raises(RuntimeError, match="closed"):
    w.call("10")


def test_the_tool_environment_answers_through_the_worker():
  env = tools_env.ToolEnvironment()
  env.reset({"question": "1+2=", "answer": "3"})
  assert env.step("<calc>12+30</calc>").observation == "<result>42</result>"
  bad = env.step("<calc>(9**999*9**999*9**999*9**999)**1000</calc>")
  assert not bad.done and "4000 digits" in bad.info["error"]

"""Progress suits where it is written: plain lines at the interval (and at the end) when the stream is
not a terminal, never a carriage return; a live bar on a terminal."""

import io

import pytest

from asyncrl_jax.infra import progress as progress_lib


class Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


def test_a_log_gets_one_plain_line_per_interval_and_one_at_the_end():
  out, clock = io.StringIO(), Clock()
  bar = progress_lib.LineProgress(100, desc="async RL", unit="step", initial=10, file=out, every=30.0,
                                  clock=clock)
  for _ in range(90):  # one step a second
    clock.t += 1.0
    bar.update(1)
    bar.set_postfix(reward="0.50")
  bar.close()
  bar.close()  # (once)
  lines = out.getvalue().splitlines()
  assert "\r" not in out.getvalue()
  assert lines == ["[async RL] 40/100 step (40%), 30s, 1.00 step/s [reward=0.50]",
                   "[async RL] 70/100 step (70%), 60s, 1.00 step/s [reward=0.50]",
                   "[async RL] 100/100 step (100%), 90s, 1.00 step/s [reward=0.50]"]  # (close: no repeat)
  # a close between intervals writes the final count
  out, clock = io.StringIO(), Clock()
  bar = progress_lib.LineProgress(None, desc="warm start", unit="step", file=out, every=30.0, clock=clock)
  clock.t = 5.0
  bar.update(7)
  bar.close()
  assert out.getvalue() == "[warm start] 7 step, 5s, 1.40 step/s\n"


def test_a_file_gets_lines_and_a_terminal_gets_a_bar(monkeypatch):
  monkeypatch.setenv("ASYNCRL_PROGRESS_SECONDS", "5")
  assert isinstance(progress_lib.progress(3, desc="x", file=io.StringIO()), progress_lib.LineProgress)

  class Terminal(io.StringIO):
    def isatty(self):
      return True

  bar = progress_lib.progress(3, desc="x", file=Terminal())
  assert not isinstance(bar, progress_lib.LineProgress) and type(bar).__name__ == "tqdm"
  bar.close()


def test_a_bad_interval_is_named(monkeypatch):
  monkeypatch.setenv("ASYNCRL_PROGRESS_SECONDS", "soon")
  with pytest.raises(ValueError, match="ASYNCRL_PROGRESS_SECONDS='soon'"):
    progress_lib.interval_seconds()

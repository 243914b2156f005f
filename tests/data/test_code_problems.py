"""Code problems imported from LiveCodeBench and DeepCoder rows: the tests in our form (checked by
running a reference solution on them in the sandbox), the prompt, and each malformed row refused by
name."""

import base64
import json
import pickle
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl_jax.data import builder, code_problems
from asyncrl_jax.data.code_problems import CodeDataError
from asyncrl_jax.data.pipeline import read_split
from asyncrl_jax.rl.rewards import code_reward

LCB_STDIN = {
    "question_title": "sum", "question_content": "Read two integers and print their sum.",
    "platform": "atcoder", "starter_code": "", "difficulty": "easy",
    "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
    "private_test_cases": json.dumps([{"input": "40 2\n", "output": "42\n", "testtype": "stdin"},
                                      {"input": "-1 1\n", "output": "0\n", "testtype": "stdin"}]),
    "metadata": "{}"}
LCB_FUNCTIONAL = {
    "question_content": "Return the largest element of nums plus k.", "platform": "leetcode",
    "starter_code": "class Solution:\n    def maxPlus(self, nums: List[int], k: int) -> int:\n        ",
    "public_test_cases": json.dumps([{"input": "[1, 5, 3]\n2", "output": "7", "testtype": "functional"}]),
    "private_test_cases": json.dumps([{"input": "[-4]\n0", "output": "-4", "testtype": "functional"}]),
    "metadata": json.dumps({"func_name": "maxPlus"})}
DEEPCODER = {"problem": "Print the input reversed.",
             "tests": json.dumps([{"input": "abc\n", "output": "cba\n", "testtype": "stdin_stdout"}])}
TACO_FN = {"problem": "Double it.", "tests": json.dumps({"inputs": [[2], [5]], "outputs": [[4], [10]],
                                                         "fn_name": "double"})}
SOLUTIONS = {
    "sum": "a, b = map(int, input().split())\nprint(a + b)",
    "maxPlus": "class Solution:\n    def maxPlus(self, nums, k):\n        return max(nums) + k",
    "reverse": "print(input()[::-1])",
    "double": "def double(x):\n    return 2 * x",
}


def _fenced(code: str) -> str:
  return f"```python\n{code}\n```"


def test_rows_of_both_formats_become_tests_a_reference_solution_passes():
  stdin = code_problems.tests_from_row(LCB_STDIN)
  assert stdin == {"stdin": [{"input": "1 2\n", "output": "3\n"}, {"input": "40 2\n", "output": "42\n"},
                             {"input": "-1 1\n", "output": "0\n"}], "public": 1}
  fn = code_problems.tests_from_row(LCB_FUNCTIONAL)
  assert fn == {"fn_name": "maxPlus", "cases": [{"args": [[1, 5, 3], 2], "output": 7},
                                                {"args": [[-4], 0], "output": -4}], "public": 1}
  taco = code_problems.tests_from_row(TACO_FN)
  assert taco["cases"] == [{"args": [2], "output": 4}, {"args": [5], "output": 10}]
  for tests, solution in ((stdin, "sum"), (fn, "maxPlus"), (code_problems.tests_from_row(DEEPCODER), "reverse"), (taco, "double")):
    assert code_reward(_fenced(SOLUTIONS[solution]), tests) == 1.0
    assert code_reward(_fenced("print(0)"), tests) == 0.0  # (the control)
  prompt = code_problems.prompt_text(LCB_FUNCTIONAL, fn)
  assert prompt.startswith("Return the largest") and "class Solution:" in prompt and "`maxPlus`" in prompt


@pytest.mark.parametrize("row,message", [
    ({"question_content": "x"}, "has no tests"),
    (dict(LCB_STDIN, private_test_cases=base64.b64encode(zlib.compress(pickle.dumps("[]"))).decode()),
     "never unpickles"),
    (dict(LCB_STDIN, public_test_cases="[{oops"), "public_test_cases is not valid JSON"),
    (dict(LCB_STDIN, public_test_cases=json.dumps([{"input": "1", "output": "2", "testtype": "interactive"}])),
     "testtype='interactive'"),
    (dict(LCB_FUNCTIONAL, metadata="{}"), "no func_name"),
    (dict(LCB_FUNCTIONAL, public_test_cases=json.dumps([{"input": "[1", "output": "1", "testtype": "functional"}])),
     "not one JSON value per line"),
    (dict(LCB_STDIN, private_test_cases=LCB_FUNCTIONAL["private_test_cases"]), "mixes stdin and functional"),
    ({"problem": "x", "tests": json.dumps({"inputs": [1], "outputs": []})}, "one length"),
    ({"problem": "x", "tests": "[]"}, "no tests"),
])
def test_malformed_rows_are_refused_by_name(row, message):
  with pytest.raises(CodeDataError, match=message):
    code_problems.tests_from_row(row, "train.jsonl row 3")


def test_files_import_into_the_task_dataset_jsonl_and_parquet(tmp_path):
  train = tmp_path / "code_train.jsonl"
  train.write_text("\n".join(json.dumps(r) for r in (LCB_STDIN, LCB_FUNCTIONAL, DEEPCODER)) + "\n")
  test = tmp_path / "code_test.parquet"
  pq.write_table(pa.Table.from_pylist([{"problem": TACO_FN["problem"], "tests": TACO_FN["tests"]}]), str(test))
  made = builder.build_math(str(tmp_path / "data"), {"train": str(train), "test": str(test)}, code=True)
  rows = read_split(made, "train")
  assert len(rows) == 3 and len(read_split(made, "test")) == 1
  by_question = {r["question"].split("\n")[0]: r for r in rows}
  record = by_question["Return the largest element of nums plus k."]
  assert json.loads(record["answer"])["fn_name"] == "maxPlus"
  assert code_reward(_fenced(SOLUTIONS["maxPlus"]), record["answer"]) == 1.0
  bad = tmp_path / "bad_train.jsonl"
  bad.write_text(json.dumps(LCB_STDIN) + "\n" + json.dumps({"problem": "no tests"}) + "\n")
  with pytest.raises(CodeDataError, match="bad_train.jsonl row 2 has no tests"):
    builder.build_math(str(tmp_path / "data2"), {"train": str(bad)}, code=True)


def test_humaneval_ships_with_the_package_and_its_checks_run_in_the_sandbox():
  from asyncrl_jax.tools import evaluate as eval_cli  # pylint: disable=import-outside-toplevel
  problems = code_problems.humaneval()
  assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
  assert len(eval_cli.read_problems("humaneval", limit=3)) == 3
  for p in problems[::12]:  # 14 of them, across the set
    tests = json.loads(p["answer"])
    body = p["solution"][len(tests["prompt"]):]
    assert code_reward(_fenced(p["solution"]), tests) == 1.0, p["task_id"]  # the whole function
    assert code_reward(_fenced(body), tests) == 1.0, p["task_id"]  # the body alone completes the prompt
    assert code_reward(_fenced(tests["prompt"] + "    return None\n"), tests) == 0.0, p["task_id"]  # control

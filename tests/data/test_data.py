"""Data: the TFDS builders (array_record, no TensorFlow), the grain prompt stream, rewards."""

import json
import types

import pytest

from asyncrl_jax.data import builder as builder_lib, pipeline
from asyncrl_jax.rl.rewards import MathReward, arithmetic_reward


@pytest.fixture(scope="module")
def arithmetic(tmp_path_factory):
  return builder_lib.build_arithmetic(str(tmp_path_factory.mktemp("tfds")), num_train=200, num_test=30,
                                      seed=3, min_terms=2, max_terms=9)


def test_arithmetic_builder_splits_and_records(arithmetic):
  assert arithmetic.info.splits["train"].num_examples == 200
  assert arithmetic.info.splits["test"].num_examples == 30
  for r in pipeline.read_split(arithmetic, "test"):
    digits = [int(x) for x in r["question"][:-1].split("+")]
    assert str(sum(digits)) == r["answer"] and 2 <= len(digits) <= 9
    assert arithmetic_reward(r["solution"], r["answer"]) == 1.0
  import importlib.util
  assert importlib.util.find_spec("tensorflow") is None


def test_prompt_stream_state_round_trip_and_sharding(arithmetic):
  source = arithmetic.as_data_source(split="train")
  stream = pipeline.PromptStream(source, seed=1, shard_index=0, shard_count=1)
  for _ in range(5):
    stream.next()
  state = json.loads(json.dumps(stream.get_state()))  # survives a JSON checkpoint
  after = [stream.next() for _ in range(4)]
  resumed = pipeline.PromptStream(source, seed=1, shard_index=0, shard_count=1)
  resumed.set_state(state)
  again = [resumed.next() for _ in range(4)]
  assert [(p.index, p.question) for p in again] == [(p.index, p.question) for p in after]
  assert after[0].index == 5
  # Two processes see disjoint halves that together cover the split once per epoch.
  halves = [pipeline.PromptStream(source, seed=1, shard_index=i, shard_count=2) for i in range(2)]
  seen = [[h.next().question for _ in range(100)] for h in halves]
  all_q = sorted(r["question"] for r in pipeline.read_split(arithmetic, "train"))
  assert sorted(seen[0] + seen[1]) == all_q
  # Repeat: the stream keeps going past one epoch.
  full = pipeline.PromptStream(source, seed=1, shard_index=0, shard_count=1)
  qs = [full.next().question for _ in range(400)]
  assert sorted(qs[:200]) == sorted(qs[200:]) == all_q


def test_math_jsonl_import(tmp_path):
  train = tmp_path / "train.jsonl"
  train.write_text("\n".join(json.dumps(r) for r in [
      {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
      {"question": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"}]) + "\n")
  b = builder_lib.build_math(str(tmp_path / "tfds"), {"train": str(train)})
  records = pipeline.read_split(b, "train")
  assert sorted(r["answer"] for r in records) == ["7", "\\frac{3}{4}"]
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"question": "q", "answer": "1"}\n{oops\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
    list(builder_lib.read_records(str(bad)))
  missing = tmp_path / "missing.jsonl"
  missing.write_text('{"problem": "q", "solution": "1"}\n')
  with pytest.raises(Exception, match=r"lacks 'question \(or problem\)' or 'answer'"):
    builder_lib.build_math(str(tmp_path / "tfds2"), {"train": str(missing)})


@pytest.mark.parametrize("content, message", [
    (b'{"question": "1+1?", "answer": "2"}\n{"question": "  ", "answer": "3"}\n',
     r"record 2: the 'question' is empty"),
    (b'{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "####  "}\n',
     r"record 2: the 'answer' is empty"),
    (b'{"question": "1+1?", "answer": null}\n', r"record 1 lacks 'question \(or problem\)' or 'answer'"),
    (b'{"question": "1+1?", "answer": "2"}\n[1, 2]\n', r"record 2 is not an object"),
    (b'{"question": "1+1?", "answer": "2"}\n{"question": "\xff\xfe", "answer": "3"}\n',
     r"bad.jsonl:2: not UTF-8 \(invalid start byte at byte 14\)"),
])
def test_bad_rows_are_refused_at_build_time_with_their_number(tmp_path, content, message):
  bad = tmp_path / "bad.jsonl"
  bad.write_bytes(content)
  with pytest.raises(Exception, match=message):
    builder_lib.build_math(str(tmp_path / "tfds"), {"train": str(bad)})


def test_builder_from_config_for_each_task(tmp_path):
  from asyncrl_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  train, test = tmp_path / "gsm_train.jsonl", tmp_path / "gsm_test.jsonl"
  train.write_text(json.dumps({"question": "1+2?", "answer": "#### 3"}) + "\n")
  test.write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")
  c = config_lib.base_config()
  c.data.task, c.data.path = "jsonl", str(train)
  b = builder_lib.from_config(c, str(tmp_path / "run"))  # the test file beside it is found
  assert builder_lib.held_out_split(b) == "test"
  assert [r["answer"] for r in pipeline.read_split(b, "test")] == ["4"]
  test.unlink()
  b = builder_lib.from_config(c, str(tmp_path / "run2"))  # no test file: evaluation uses train
  assert builder_lib.held_out_split(b) == "train"
  c.data.task, c.data.path = "tfds", b.data_dir  # a prepared TFDS directory
  again = builder_lib.from_config(c, str(tmp_path / "unused"))
  assert [r["question"] for r in pipeline.read_split(again, "train")] == ["1+2?"]
  c.data.task, c.data.path = "arithmetic", str(tmp_path / "arith")
  c.data.num_train, c.data.num_test = 20, 5
  assert builder_lib.from_config(c, "unused").info.splits["test"].num_examples == 5


def test_math_verify_reward_and_timeout():
  reward = MathReward(timeout=30.0)
  try:
    assert reward("so the answer is \\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert reward("The answer is $7$.", "7") == 1.0
    assert reward("The answer is $8$.", "7") == 0.0
  finally:
    reward.close()
  # the per-call timeout does not count the worker's start (spawn + importing sympy takes seconds)
  warm = MathReward(timeout=1.0)
  try:
    assert warm("The answer is $7$.", "7") == 1.0 and warm.timeouts == 0
  finally:
    warm.close()
  hasty = MathReward(timeout=1e-6)
  try:
    assert hasty("\\boxed{1}", "1") == 0.0 and hasty.timeouts == 1
  finally:
    hasty.close()


def test_reward_workers_survive_answers_that_explode_or_kill_them():
  from tests.fixtures import reward_faults  # pylint: disable=import-outside-toplevel
  for fn, counted in ((reward_faults.hog, "failures"), (reward_faults.die, "failures")):
    reward = MathReward(timeout=60.0, max_memory=2 ** 30, verify=fn)
    try:
      assert reward("x", "y") == 0.0 and getattr(reward, counted) == 1
      reward._verify = reward_faults.exact  # pylint: disable=protected-access
      assert reward("7", "7") == 1.0  # the pool still works (a dead worker was replaced)
    finally:
      reward.close()


def test_tfds_progress_bars_are_off_when_stdout_is_not_a_terminal(monkeypatch):
  import io  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.data import builder as builder_lib  # pylint: disable=import-outside-toplevel
  calls = []
  monkeypatch.setattr(builder_lib.tfds, "disable_progress_bar", lambda: calls.append("off"))
  prepared = types.SimpleNamespace(download_and_prepare=lambda: calls.append("prepared"))

  class Terminal(io.StringIO):
    def isatty(self):
      return True

  for stream, want in ((io.StringIO(), ["off", "prepared"]), (Terminal(), ["prepared"])):
    calls.clear()
    monkeypatch.setattr(sys, "stdout", stream)
    builder_lib._prepare(prepared)  # pylint: disable=protected-access
    assert calls == want

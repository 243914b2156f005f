"""TFDS builder of the built-in task (array_record files, no TensorFlow needed) and of imported math data.

``build_arithmetic(data_dir, ...)`` writes ``data_dir/arithmetic_reasoning/<version>/`` with ``train`` and
``test`` splits of the chain-of-thought addition task (``asyncrl_jax.data.arithmetic``); the test split
uses a different seed, so held-out problems are new draws (an exact duplicate of a train question is
possible for very short sums, as in any such task). ``build_math_jsonl`` imports question/answer records
(GSM8K / MATH / DeepScaleR style JSONL or Parquet files) into the same feature schema.

``from_config`` prepares the dataset in ``WORKDIR/data``, or, for a bucket workdir (``gs://...``), in a
local cache directory named after what the records are made from (``prepared_dir``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Iterable, Iterator, Optional

import numpy as np
import tensorflow_datasets as tfds

from asyncrl_jax.data import arithmetic, code_functions, code_problems, tool_arithmetic
from asyncrl_jax.infra import paths

def _features():
  return tfds.features.FeaturesDict({
      "question": tfds.features.Text(), "answer": tfds.features.Text(),
      "solution": tfds.features.Text(), "num_terms": tfds.features.Scalar(dtype=np.int32)})


class _QABuilder(tfds.core.GeneratorBasedBuilder):
  """Shared shape of our builders: one feature schema, one generator per split name."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  DESCRIPTION = ""

  def _info(self) -> tfds.core.DatasetInfo:
    # Built directly: dataset_info_from_configs() needs the builder to live in a TFDS-style package.
    return tfds.core.DatasetInfo(builder=self, features=_features(), description=self.DESCRIPTION)

  def _split_generators(self, dl_manager):
    del dl_manager
    return {split: self._generate_examples(split) for split in self._split_names()}

  def _split_names(self) -> Iterable[str]:
    raise NotImplementedError


class ArithmeticReasoning(_QABuilder):
  """Chain-of-thought addition with lognormal reasoning length (train / test)."""

  DESCRIPTION = "Chain-of-thought addition, heavy-tailed length."

  def __init__(self, *, num_train: int = 20000, num_test: int = 500, seed: int = 0, min_terms: int = 2,
               max_terms: int = 16, **kwargs):
    self._sizes = {"train": num_train, "test": num_test}
    self._seed, self._min, self._max = seed, min_terms, max_terms
    super().__init__(**kwargs)

  def _split_names(self):
    return self._sizes

  def _generate_examples(self, split: str) -> Iterator:
    rng = np.random.default_rng([self._seed, 0 if split == "train" else 1])
    for i in range(self._sizes[split]):
      p = arithmetic.make_problem(rng, self._min, self._max)
      yield f"{split}-{i}", {"question": p.question, "answer": p.answer, "solution": p.solution,
                             "num_terms": p.num_terms}


class ToolArithmetic(ArithmeticReasoning):
  """Sums of multi-digit numbers for the calculator tool (train / test, ``data.tool_arithmetic``)."""

  DESCRIPTION = "Multi-digit sums, solved with a calculator call."

  def __init__(self, *, max_digits: int = 4, **kwargs):
    self._digits = max_digits
    super().__init__(**kwargs)

  def _generate_examples(self, split: str) -> Iterator:
    rng = np.random.default_rng([self._seed, 0 if split == "train" else 1])
    for i in range(self._sizes[split]):
      p = tool_arithmetic.make_problem(rng, self._min, self._max, self._digits)
      yield f"{split}-{i}", {"question": p.question, "answer": p.answer, "solution": p.solution,
                             "num_terms": p.num_terms}


class CodeFunctions(ArithmeticReasoning):
  """The built-in code task (``data.code_functions``): a program for a function shown by examples."""

  DESCRIPTION = "Programs for linear functions shown by examples, scored on hidden tests."

  def _generate_examples(self, split: str) -> Iterator:
    rng = np.random.default_rng([self._seed, 0 if split == "train" else 1])
    for i in range(self._sizes[split]):
      p = code_functions.make_problem(rng)
      yield f"{split}-{i}", {"question": p.question, "answer": p.answer, "solution": p.solution,
                             "num_terms": p.num_terms}


class MathQA(_QABuilder):
  """Question / answer records imported from local JSONL or Parquet files."""

  DESCRIPTION = "Imported math question/answer data."

  def __init__(self, *, files: Optional[dict] = None, question_key: Optional[str] = None,
               answer_key: str = "answer", **kwargs):
    # question_key None: "question", else "problem" (the MATH / AIME / DeepScaleR layout)
    self._files = files or {}
    self._qk, self._ak = question_key, answer_key
    super().__init__(**kwargs)

  def _split_names(self):
    return self._files

  def _generate_examples(self, split: str) -> Iterator:
    for i, record in enumerate(read_records(self._files[split])):
      where = f"{self._files[split]} record {i + 1}"
      if not isinstance(record, dict):
        raise ValueError(f"{where} is not an object: {str(record)[:80]!r}")
      qk = self._qk or ("problem" if "question" not in record and "problem" in record else "question")
      if qk not in record or self._ak not in record or record[self._ak] is None:
        raise ValueError(f"{where} lacks {self._qk or 'question (or problem)'!r}"
                         f" or {self._ak!r}: keys {sorted(record)}")
      question, answer = str(record[qk]), final_answer(record[self._ak])
      if not question.strip():
        raise ValueError(f"{where}: the {qk!r} is empty")
      if not answer:
        raise ValueError(f"{where}: the {self._ak!r} is empty")
      yield f"{split}-{i}", {"question": question, "answer": answer,
                             "solution": str(record[self._ak]), "num_terms": 0}


class CodeQA(MathQA):
  """Code problems imported from local JSONL or Parquet files (``data.code_problems``): the prompt as
  the question, the tests' JSON as the answer."""

  DESCRIPTION = "Imported code problems with their tests."

  def _generate_examples(self, split: str) -> Iterator:
    for i, record in enumerate(code_problems.records(read_records(self._files[split]), self._files[split])):
      yield f"{split}-{i}", record


def read_records(path: str) -> Iterable[dict]:
  """Records of a .jsonl / .json (list) / .parquet file; a malformed line raises with its number."""
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    yield from pq.read_table(path).to_pylist()
    return
  with open(path, "rb") as f:
    if path.endswith(".json"):
      yield from json.load(f)
      return
    for n, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{n}: not UTF-8 ({e.reason} at byte {e.start})") from None
      if line.strip():
        try:
          yield json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None


def final_answer(answer) -> str:
  """GSM8K writes the final answer after '####'; other sources give it directly."""
  text = str(answer)
  return text.rsplit("####", 1)[1].strip() if "####" in text else text.strip()


def _prepare(builder) -> None:
  """``download_and_prepare`` with TFDS's progress bars only on a terminal (in a log file their
  redraws become one line of carriage returns)."""
  if not sys.stdout.isatty():
    tfds.disable_progress_bar()
  builder.download_and_prepare()


def build_arithmetic(data_dir: str, *, num_train: int, num_test: int, seed: int, min_terms: int,
                     max_terms: int, max_digits: int = 0) -> ArithmeticReasoning:
  """The chain-of-thought task, or (``max_digits > 0``) the tool task's sums of multi-digit numbers."""
  kind = dict(cls=ToolArithmetic, max_digits=max_digits) if max_digits else dict(cls=ArithmeticReasoning)
  if max_digits < 0:  # (the built-in code task)
    kind = dict(cls=CodeFunctions)
  builder = kind.pop("cls")(num_train=num_train, num_test=num_test, seed=seed, min_terms=min_terms,
                            max_terms=max_terms, data_dir=data_dir, file_format="array_record", **kind)
  _prepare(builder)
  return builder


def build_math(data_dir: str, files: dict, *, code: bool = False, **keys) -> MathQA:
  """Imports question/answer files (``code``: code problems with tests) into ``data_dir``."""
  missing = [p for p in files.values() if not os.path.exists(p)]
  if missing:
    raise FileNotFoundError(f"{'code' if code else 'math'} data files not found: {missing}")
  builder = (CodeQA if code else MathQA)(files=files, data_dir=data_dir, file_format="array_record", **keys)
  _prepare(builder)
  return builder


def _file_digest(path: str) -> str:
  """SHA-256 of a source file's bytes; "" for a missing file (``build_math`` then names it)."""
  if not os.path.exists(path):
    return ""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def local_cache_dir() -> str:
  """``$XDG_CACHE_HOME/asyncrl_jax/data`` (default ``~/.cache/asyncrl_jax/data``)."""
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(cache, "asyncrl_jax", "data")


def prepared_dir(workdir: str, task: str, made_from: dict) -> str:
  """The TFDS ``data_dir`` that ``from_config`` prepares a ``task`` dataset in.

  ``WORKDIR/data`` for a local workdir. For a bucket workdir, ``local_cache_dir()/TASK-HASH`` with HASH a
  digest of ``made_from`` (the generator's settings, or the source files' digests), so a changed
  config or file never reuses stale records and a resume or a rerun reuses the same ones. Not the
  bucket: TFDS's array_record writer opens local files only (a ``gs://`` data_dir fails when a split is
  finalised), only learner process 0 reads the prompts, grain reads them a record at a time in shuffled
  order, and the records are a pure function of the config or of local files: nothing to share.
  """
  if not paths.is_remote(workdir):
    return os.path.join(workdir, "data")
  key = hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:16]
  return os.path.join(local_cache_dir(), f"{task}-{key}")


def from_config(config, workdir: str):
  """The dataset builder that ``config.data`` names, prepared (built or imported) if it is not yet.

  ``arithmetic``: the built-in task in ``data.path`` (default ``prepared_dir``, ``WORKDIR/data`` for a
  local workdir); ``jsonl``: the records of ``data.path`` (and of the same path with ``train`` replaced
  by ``test``, when that file exists) imported into ``prepared_dir``; ``code_jsonl``: the same for code
  problems (``data.code_problems``); ``tfds``: a prepared TFDS
  directory at ``data.path``.
  """
  data = config.data
  if data.task in BUILT_IN:
    settings = dict(num_train=data.num_train, num_test=data.num_test, seed=data.seed,
                    min_terms=data.min_terms, max_terms=data.max_terms, **_digits(data))
    return build_arithmetic(data.path or prepared_dir(workdir, data.task, settings), **settings)
  if data.task in ("jsonl", "code_jsonl"):
    files = {"train": data.path}
    test = data.path.replace("train", "test")
    if test != data.path and os.path.exists(test):
      files["test"] = test
    # Only the cache directory is named by digests (a read of each file); WORKDIR/data is not.
    made_from = {split: _file_digest(p) for split, p in files.items()} if paths.is_remote(workdir) else {}
    return build_math(prepared_dir(workdir, data.task, made_from), files, code=data.task == "code_jsonl")
  return tfds.builder_from_directory(os.path.expanduser(data.path))


BUILT_IN = ("arithmetic", "tool_arithmetic", "code_functions")


def _digits(data) -> dict:
  if data.task == "code_functions":
    return dict(max_digits=-1)
  return dict(max_digits=data.max_digits) if data.task == "tool_arithmetic" else {}


DEMONSTRATION_SEED_OFFSET = 1_000_003  # demonstrations are other draws than the RL prompts


def demonstrations_from_config(config, workdir: str):
  """The dataset whose train split the supervised warm start reads: the task's own (``from_config``),
  or, with ``data.demo_max_terms > 0``, built-in chains of 2 to ``demo_max_terms`` terms drawn with
  another seed, prepared apart from the RL prompts (``DATA_PATH-demonstrations``, or
  ``WORKDIR/data-demonstrations``): the longer chains RL trains on have no demonstration."""
  data = config.data
  if not data.demo_max_terms:
    return from_config(config, workdir)
  settings = dict(num_train=data.num_train, num_test=data.num_test,
                  seed=data.seed + DEMONSTRATION_SEED_OFFSET, min_terms=2, max_terms=data.demo_max_terms,
                  **_digits(data))
  if data.path:
    path = data.path.rstrip("/") + "-demonstrations"
  elif paths.is_remote(workdir):
    path = prepared_dir(workdir, f"{data.task}-demonstrations", settings)
  else:
    path = os.path.join(workdir, "data-demonstrations")
  return build_arithmetic(path, **settings)


def held_out_split(builder) -> str:
  """``test`` when the dataset has one, else its first split (evaluation then reuses training data)."""
  splits = list(builder.info.splits.keys())
  return "test" if "test" in splits else splits[0]

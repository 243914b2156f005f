"""TFDS builder of the built-in task (array_record files, no TensorFlow needed) and of imported math data.

``build_arithmetic(data_dir, ...)`` writes ``data_dir/arithmetic_reasoning/<version>/`` with ``train`` and
``test`` splits of the chain-of-thought addition task (``asyncrl_jax.data.arithmetic``); the test split
uses a different seed, so held-out problems are new draws (an exact duplicate of a train question is
possible for very short sums, as in any such task). ``build_math_jsonl`` imports question/answer records
(GSM8K / MATH / DeepScaleR style JSONL or Parquet files) into the same feature schema.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator, Optional

import numpy as np
import tensorflow_datasets as tfds

from asyncrl_jax.data import arithmetic

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


class MathQA(_QABuilder):
  """Question / answer records imported from local JSONL or Parquet files."""

  DESCRIPTION = "Imported math question/answer data."

  def __init__(self, *, files: Optional[dict] = None, question_key: str = "question",
               answer_key: str = "answer", **kwargs):
    self._files = files or {}
    self._qk, self._ak = question_key, answer_key
    super().__init__(**kwargs)

  def _split_names(self):
    return self._files

  def _generate_examples(self, split: str) -> Iterator:
    for i, record in enumerate(read_records(self._files[split])):
      if self._qk not in record or self._ak not in record:
        raise ValueError(f"{self._files[split]} record {i} lacks {self._qk!r} or {self._ak!r}: "
                         f"keys {sorted(record)}")
      yield f"{split}-{i}", {"question": str(record[self._qk]), "answer": final_answer(record[self._ak]),
                             "solution": str(record[self._ak]), "num_terms": 0}


def read_records(path: str) -> Iterable[dict]:
  """Records of a .jsonl / .json (list) / .parquet file; a malformed line raises with its number."""
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    yield from pq.read_table(path).to_pylist()
    return
  with open(path) as f:
    if path.endswith(".json"):
      yield from json.load(f)
      return
    for n, line in enumerate(f, start=1):
      if line.strip():
        try:
          yield json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None


def final_answer(answer) -> str:
  """GSM8K writes the final answer after '####'; other sources give it directly."""
  text = str(answer)
  return text.rsplit("####", 1)[1].strip() if "####" in text else text.strip()


def build_arithmetic(data_dir: str, *, num_train: int, num_test: int, seed: int, min_terms: int,
                     max_terms: int) -> ArithmeticReasoning:
  builder = ArithmeticReasoning(num_train=num_train, num_test=num_test, seed=seed, min_terms=min_terms,
                                max_terms=max_terms, data_dir=data_dir, file_format="array_record")
  builder.download_and_prepare()
  return builder


def build_math(data_dir: str, files: dict, **keys) -> MathQA:
  missing = [p for p in files.values() if not os.path.exists(p)]
  if missing:
    raise FileNotFoundError(f"math data files not found: {missing}")
  builder = MathQA(files=files, data_dir=data_dir, file_format="array_record", **keys)
  builder.download_and_prepare()
  return builder


def from_config(config, workdir: str):
  """The dataset builder that ``config.data`` names, prepared (built or imported) if it is not yet.

  ``arithmetic``: the built-in task in ``data.path`` (default ``WORKDIR/data``); ``jsonl``: the records
  of ``data.path`` (and of the same path with ``train`` replaced by ``test``, when that file exists)
  imported into ``WORKDIR/data``; ``tfds``: a prepared TFDS directory at ``data.path``.
  """
  data = config.data
  if data.task == "arithmetic":
    return build_arithmetic(data.path or os.path.join(workdir, "data"), num_train=data.num_train,
                            num_test=data.num_test, seed=data.seed, min_terms=data.min_terms,
                            max_terms=data.max_terms)
  if data.task == "jsonl":
    files = {"train": data.path}
    test = data.path.replace("train", "test")
    if test != data.path and os.path.exists(test):
      files["test"] = test
    return build_math(os.path.join(workdir, "data"), files)
  return tfds.builder_from_directory(os.path.expanduser(data.path))


def held_out_split(builder) -> str:
  """``test`` when the dataset has one, else its first split (evaluation then reuses training data)."""
  splits = list(builder.info.splits.keys())
  return "test" if "test" in splits else splits[0]

"""The workdir's path layer on local paths and on a fake ``gs://`` bucket: a run log written into the
bucket holds exactly its records, a resume reads them back, and no local ``gs:`` directory appears."""

import importlib
import json
import os
import types

import fsspec
import pytest
from etils.epath import backend as epath_backend
from etils.epath import gpath
from fsspec.implementations.memory import MemoryFileSystem

from asyncrl_jax import config as config_lib
from asyncrl_jax.infra import paths
from asyncrl_jax.rollout.stats import DecodeStats
from asyncrl_jax.train import runlog


@pytest.fixture
def bucket(monkeypatch, tmp_path):
  """``gs://`` served by an in-memory fsspec file system that, like GCS, cannot append, behind the real
  ``epath`` code; the test runs in an empty current directory, so a stray local ``gs:`` shows."""

  class FakeGCS(MemoryFileSystem):
    protocol = ("gs", "gcs")
    store, pseudo_dirs = {}, [""]  # this test's own

    @classmethod
    def _strip_protocol(cls, path):
      path = str(path)
      for prefix in ("gs://", "gcs://"):
        path = path[len(prefix):] if path.startswith(prefix) else path
      return super()._strip_protocol(path)

    def _open(self, path, mode="rb", **kwargs):  # pylint: disable=arguments-differ
      if "a" in mode:
        raise NotImplementedError(f"{path}: objects cannot be appended to")
      return super()._open(path, mode, **kwargs)

  from tensorboardX import record_writer  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(record_writer.REGISTERED_FACTORIES, "gs", record_writer.REGISTERED_FACTORIES.get("gs"))
  registered = importlib.import_module("fsspec.registry")._registry  # pylint: disable=protected-access
  for name in ("gs", "gcs"):
    monkeypatch.setitem(registered, name, FakeGCS)  # what fsspec.register_implementation sets
  monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)
  monkeypatch.setattr(paths, "_has_tensorflow", lambda: False)
  cache = type(epath_backend.fsspec_backend)._get_filesystem  # pylint: disable=protected-access
  cache.cache_clear()
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  yield FakeGCS.store
  cache.cache_clear()
  assert not os.listdir(cwd), f"local files written for bucket paths: {os.listdir(cwd)}"


def _object(store, uri: str) -> bytes:
  return store["/" + uri[len("gs://"):]].getvalue()


def test_local_paths_behave_as_os_calls(tmp_path):
  d = paths.join(str(tmp_path), "run", "sub")
  paths.makedirs(d)
  paths.makedirs(d)  # already there: fine
  f = paths.join(d, "a.jsonl")
  assert f == os.path.join(str(tmp_path), "run", "sub", "a.jsonl")
  paths.append_text(f, '{"v": 1}\n')
  paths.append_text(f, '{"v": 2}\n')
  assert (tmp_path / "run" / "sub" / "a.jsonl").read_text() == '{"v": 1}\n{"v": 2}\n'
  paths.write_text(f, "new")
  assert paths.read_text(f) == "new" and os.listdir(d) == ["a.jsonl"]  # no temporary file left
  assert paths.exists(f) and paths.isdir(d) and not paths.is_remote(f)
  paths.remove(f)
  assert not paths.exists(f) and paths.listdir(d) == []
  assert paths.absolute("rel") == os.path.join(os.getcwd(), "rel")


def test_bucket_uris_stay_uris():
  assert paths.join("gs://b/run", "checkpoints") == "gs://b/run/checkpoints"
  assert paths.absolute("gs://b/run") == "gs://b/run"
  assert os.path.abspath("gs://b/run") != "gs://b/run"  # what the call sites did before
  assert paths.is_remote("gs://b/run") and paths.is_remote("s3://b")


def test_the_pinned_requirements_reach_gs_buckets():
  """requirements.txt pins gcsfs, so a gs:// workdir works without TensorFlow (epath then uses fsspec)."""
  assert fsspec.get_filesystem_class("gs").__module__.startswith("gcsfs.")  # a class: no credentials looked up
  paths.require_backend("gs://b/run/config.json")


def test_a_scheme_without_a_backend_is_refused_by_name(monkeypatch):
  monkeypatch.setattr(paths, "_has_tensorflow", lambda: False)
  with pytest.raises(paths.RemoteStorageError, match=r"nosuchfs://b/run/config.json: nosuchfs:// paths need"):
    paths.exists("nosuchfs://b/run/config.json")


def test_without_gcsfs_a_bucket_is_refused_naming_gcsfs(monkeypatch):
  """What fsspec raises for gs:// when gcsfs is not installed (its registry's error text)."""
  def get_filesystem_class(scheme):
    assert scheme == "gs", scheme
    raise ImportError("Install gcsfs to access Google Storage")
  monkeypatch.setattr(fsspec, "get_filesystem_class", get_filesystem_class)
  monkeypatch.setattr(paths, "_has_tensorflow", lambda: False)
  with pytest.raises(paths.RemoteStorageError, match="pip install gcsfs"):
    paths.exists("gs://b/run/config.json")
  paths.exists("local/run/config.json")  # local paths never ask for a backend


def test_bucket_append_rewrites_the_object(bucket):
  f = "gs://bkt/run/metrics.jsonl"
  with pytest.raises(NotImplementedError):  # the fake, like GCS, refuses an append
    with fsspec.filesystem("gs").open(f, "ab") as h:
      h.write(b"x")
  paths.append_text(f, "one\n")
  paths.append_text(f, "two\n")
  assert _object(bucket, f) == b"one\ntwo\n"
  paths.write_text(f, "three\n")
  assert paths.read_text(f) == "three\n" and paths.listdir("gs://bkt/run") == ["metrics.jsonl"]
  paths.remove(f)
  assert not paths.exists(f)


def test_rewritten_file_stores_everything_written_on_each_flush(bucket):
  f = paths.RewrittenFile("gs://bkt/tb/events")
  f.write(b"ab")
  assert not paths.exists("gs://bkt/tb/events")
  f.flush()
  f.write(b"cd")
  assert _object(bucket, "gs://bkt/tb/events") == b"ab"
  f.close()
  assert _object(bucket, "gs://bkt/tb/events") == b"abcd"


def test_copy_tree_and_local_dir_round_trip(bucket, tmp_path):
  src = tmp_path / "export"
  (src / "sub").mkdir(parents=True)
  (src / "config.json").write_text("{}")
  (src / "sub" / "w.bin").write_bytes(b"\x00\x01")
  paths.copy_tree(str(src), "gs://bkt/export")
  assert _object(bucket, "gs://bkt/export/sub/w.bin") == b"\x00\x01"
  with paths.local_dir("gs://bkt/export") as local:
    assert not paths.is_remote(local)
    assert sorted(os.listdir(local)) == ["config.json", "sub"]
    assert open(os.path.join(local, "sub", "w.bin"), "rb").read() == b"\x00\x01"
  assert not os.path.exists(local)


def _batch(version: int):
  return types.SimpleNamespace(version=version, prompt_indices=[version, 10 + version],
                               prompt_digests=[f"d{version}", f"e{version}"], max_staleness_seen=1,
                               trajectories=[types.SimpleNamespace(completion_tokens=[1] * (version + 2),
                                                                    trajectory_id=f"p{version}-s0",
                                                                    finished_at=100.0 + version, turns=None)])


def _record(version: int) -> dict:
  return {"version": version, "time": float(version), "reward": 0.25 * version, "tokens_per_s": 100.0}


def test_runlog_in_a_bucket_writes_every_file_and_resumes_from_it(bucket):
  workdir = "gs://bkt/run"
  config = config_lib.base_config()
  log = runlog.RunLog(workdir, config)
  log.start_fresh()
  log.start_rl(0, DecodeStats())
  for v in (1, 2, 3):
    log.append(_record(v), _batch(v))
  log.close()
  meta = {"initial_eval_accuracy": 0.1, "initial_eval_greedy_accuracy": 0.2}
  log.finish(log.summary(meta, final_eval_accuracy=0.5, final_eval_greedy_accuracy=0.6,
                         eval_metric="sampled", steps=3))

  metrics = _object(bucket, f"{workdir}/metrics.jsonl").decode()
  assert metrics == "".join(json.dumps(_record(v)) + "\n" for v in (1, 2, 3))
  prompts = [json.loads(l) for l in _object(bucket, f"{workdir}/trained_prompts.jsonl").decode().splitlines()]
  assert prompts[1] == {"version": 2, "prompts": [2, 12], "digests": ["d2", "e2"], "completion_lengths": [4],
                        "trajectory_ids": ["p2-s0"], "finished_at": [102.0]}
  assert json.loads(_object(bucket, f"{workdir}/config.json"))["steps"] == config.steps
  summary = json.loads(_object(bucket, f"{workdir}/summary.json"))
  assert summary["final_eval_accuracy"] == 0.5 and summary["initial_eval_accuracy"] == 0.1
  assert _object(bucket, f"{workdir}/progress.png").startswith(b"\x89PNG")
  (events,) = paths.listdir(f"{workdir}/tb")
  assert events.startswith("events.out.tfevents") and b"reward" in _object(bucket, f"{workdir}/tb/{events}")

  resumed = runlog.RunLog(workdir, config)
  resumed.resume(2)
  assert [r["version"] for r in resumed.history] == [1, 2]
  assert paths.read_text(f"{workdir}/metrics.jsonl") == "".join(json.dumps(_record(v)) + "\n" for v in (1, 2))
  kept = [json.loads(l)["version"] for l in paths.read_text(f"{workdir}/trained_prompts.jsonl").splitlines()]
  assert kept == [1]  # the prompts of version 2 are trained again after the resume


def test_a_record_cut_short_in_the_bucket_is_dropped_on_resume(bucket):
  workdir = "gs://bkt/cut"
  paths.write_text(f"{workdir}/metrics.jsonl", json.dumps(_record(1)) + "\n" + '{"version": 2, "rew')
  log = runlog.RunLog(workdir, config_lib.base_config())
  log.resume(5)
  assert log.history == [_record(1)]
  assert paths.read_text(f"{workdir}/metrics.jsonl") == json.dumps(_record(1)) + "\n"


def test_the_data_of_a_bucket_workdir_is_prepared_in_a_local_cache(bucket, monkeypatch, tmp_path):
  """Neither a local ``gs:`` directory (the fixture checks the current one) nor objects in the bucket;
  the cache directory changes with what the records are made from, and only then."""
  from asyncrl_jax.data import builder as builder_lib  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.data import pipeline  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  cache = str(tmp_path / "cache" / "asyncrl_jax" / "data")
  c = config_lib.base_config()
  c.data.num_train, c.data.num_test = 12, 3
  b = builder_lib.from_config(c, "gs://bkt/run")
  assert str(b.data_dir).startswith(cache + os.sep + "arithmetic-"), b.data_dir
  assert len(pipeline.read_split(b, "train")) == 12 and len(pipeline.read_split(b, "test")) == 3
  assert builder_lib.from_config(c, "gs://bkt/other").data_dir == b.data_dir  # same records: reused
  c.data.seed = 1
  assert builder_lib.from_config(c, "gs://bkt/run").data_dir != b.data_dir

  train = tmp_path / "src" / "train.jsonl"
  train.parent.mkdir()
  train.write_text(json.dumps({"question": "1+2?", "answer": "#### 3"}) + "\n")
  c.data.task, c.data.path = "jsonl", str(train)
  first = builder_lib.from_config(c, "gs://bkt/run")
  assert str(first.data_dir).startswith(cache + os.sep + "jsonl-"), first.data_dir
  train.write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")  # the source edited
  second = builder_lib.from_config(c, "gs://bkt/run")
  assert second.data_dir != first.data_dir
  assert [r["answer"] for r in pipeline.read_split(second, "train")] == ["4"]
  assert len(os.listdir(cache)) == 4 and not any(k.startswith("/bkt") for k in bucket), sorted(bucket)


def test_the_summary_compares_before_and_after_on_the_last_evaluations_problems(tmp_path, capsys):
  """With ``initial_final_eval_*`` in the meta (the starting weights evaluated as the last version
  was), the summary keeps them and its table's "before RL" rows show them, not the smaller first
  evaluation's."""
  log = runlog.RunLog(str(tmp_path), config_lib.base_config())
  log.start_fresh()
  log.start_rl(0, DecodeStats())
  log.append(_record(1), _batch(1))
  log.close()
  meta = {"initial_eval_accuracy": 0.111, "initial_eval_greedy_accuracy": 0.222,
          "initial_final_eval_accuracy": 0.333, "initial_final_eval_greedy_accuracy": 0.444,
          "initial_final_eval_accuracy_se": 0.011, "initial_final_eval_greedy_accuracy_se": 0.022}
  summary = log.summary(meta, final_eval_accuracy=0.5, final_eval_greedy_accuracy=0.6, eval_metric="s", steps=1)
  assert {k: summary[k] for k in meta} == meta
  log.finish(summary)
  out = capsys.readouterr().out
  assert "0.333 +- 0.011" in out and "0.444 +- 0.022" in out and "0.111" not in out
  plain = runlog.RunLog(str(tmp_path / "plain"), config_lib.base_config())
  plain.start_fresh()
  plain.finish(plain.summary({"initial_eval_accuracy": 0.111, "initial_eval_greedy_accuracy": 0.222},
                             final_eval_accuracy=0.5, final_eval_greedy_accuracy=0.6, eval_metric="s", steps=0))
  assert "0.111" in capsys.readouterr().out

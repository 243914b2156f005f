"""Exporting the policy a run trained: ``python -m asyncrl_jax export --workdir=RUN --format=hf|orbax --out=DIR``.

Reads the run's ``config.json`` (the model architecture) and one checkpoint step (``--step``, default
the newest), restoring the policy parameters only (not the optimizer state), on this host's CPU.

* ``hf``: ``model.safetensors`` + ``config.json`` (Hugging Face Qwen2/Llama layout, which
  ``transformers`` loads) and, when the run's tokenizer is a ``tokenizer.json`` directory
  (``data.tokenizer_path``), its tokenizer files. The built-in tokenizer has no such files; the export
  says so.
* ``orbax``: a params-only Orbax checkpoint in ``DIR/params`` (``orbax.checkpoint.StandardCheckpointer``
  restores it without this project's code) and the model config in ``DIR/model_config.json``.
* ``peft`` (a LoRA run): the adapters alone in PEFT's layout (``adapter_config.json``,
  ``adapter_model.safetensors``), which ``peft.PeftModel.from_pretrained`` puts on the base model.
  Their base is named as the run's ``model.hf_path`` when it started from one; otherwise the base
  weights are written beside them in ``DIR/base`` (Hugging Face layout) and named so.

The run and ``DIR`` may be buckets (``gs://...``, through ``asyncrl_jax.infra.paths``). A Hugging Face export
is written locally and then copied up, and read back through a local copy (``local_export``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import tempfile
from typing import Iterator

from asyncrl_jax import cli

from asyncrl_jax.infra import paths

FORMATS = ("hf", "orbax", "peft")


class ExportError(ValueError):
  """The run cannot be exported as asked (the message names the file, step or format)."""


def run_config(workdir: str):
  """The ``ConfigDict`` a run recorded in ``workdir/config.json``."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  path = paths.join(workdir, "config.json")
  if not paths.exists(path):
    raise ExportError(f"{path} not found: is {workdir!r} a run's workdir?")
  return ml_collections.ConfigDict(json.loads(paths.read_text(path)))


def restore_params(workdir: str, step=None):
  """``(model_config, params, step)``: the policy parameters of checkpoint ``step`` (default the
  newest) as host arrays; the optimizer state is not read."""
  import jax  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.models import lora  # pylint: disable=import-outside-toplevel
  config = run_config(workdir)
  model_config = models.config_of(config)
  directory = paths.join(paths.absolute(workdir), "checkpoints")
  mgr = ocp.CheckpointManager(directory, item_names=("state", "meta"))
  steps = sorted(mgr.all_steps())
  if not steps:
    raise ExportError(f"no checkpoint in {directory}")
  step = steps[-1] if step is None else step
  if step not in steps:
    raise ExportError(f"no checkpoint step {step} in {directory} (have {steps})")
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu),
                          models.abstract_params(model_config))
  if not model_config.lora:
    item = {"params": abstract}  # the policy only: the optimizer state is never read
  else:  # a LoRA step holds the adapters; its meta names the base (train/checkpoint.py)
    adapters, base_like = lora.split_nested(abstract)
    item = {"adapters": adapters}
  out = mgr.restore(step, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                   partial_restore=True),
      meta=ocp.args.JsonRestore()))
  mgr.close()
  if not model_config.lora:
    return model_config, jax.device_get(out.state["params"]), step
  base = _lora_base(directory, step, dict(out.meta), base_like, config)
  return model_config, jax.device_get(lora.join_nested(out.state["adapters"], base)), step


def _lora_base(directory: str, step: int, meta: dict, like, config):
  """The frozen base a LoRA step's adapters go on: the run's written copy (``DIR/base``) or its
  ``model.hf_path``, checked against the fingerprint the step's meta holds."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.models import lora  # pylint: disable=import-outside-toplevel
  from flax import traverse_util  # pylint: disable=import-outside-toplevel
  record = meta.get("base")
  if record is None:
    raise ExportError(f"checkpoint step {step} in {directory} holds LoRA adapters but names no base "
                      "weights: it was written before checkpoints named their base")
  if record.get("path"):
    path = paths.join(directory, record["path"])
    if not paths.exists(path + ".json"):
      raise ExportError(f"the run's base weights ({path}) are missing or were not completely written")
    restorer = ocp.StandardCheckpointer()
    base = restorer.restore(path, like)
    restorer.close()
  else:
    if not paths.exists(paths.join(record["source"], "config.json")):
      raise ExportError(f"the adapters' base is {record['source']} (the run's model.hf_path), which "
                        "holds no config.json here: export where that directory is")
    _, base = models.load_hf(record["source"], dtype=config.model.dtype, param_dtype=config.model.param_dtype)
    want = set(traverse_util.flatten_dict(like))
    base = traverse_util.unflatten_dict({k: v for k, v in traverse_util.flatten_dict(base).items() if k in want})
  why = lora.base_mismatch(record["fingerprint"], lora.fingerprint(base))
  if why:
    raise ExportError(f"the base weights at {record.get('path') or record['source']} are not the ones "
                      f"the adapters were trained on ({why})")
  return base


def export(workdir: str, out: str, *, fmt: str = "hf", step=None) -> dict:
  """Writes the export; returns what was written (format, step, files)."""
  if fmt not in FORMATS:
    raise ExportError(f"format {fmt!r}: must be one of {FORMATS}")
  if paths.exists(out) and paths.listdir(out):
    raise ExportError(f"{out} is not empty; choose a new directory")
  model_config, params, step = restore_params(workdir, step)
  config = run_config(workdir)
  if fmt == "hf":
    tokenizer_dir = config.data.tokenizer_path or None
    write_hf(model_config, params, out, tokenizer_dir=tokenizer_dir)
    note = "" if tokenizer_dir else "the built-in tokenizer has no tokenizer files; none were written"
  elif fmt == "peft":
    if not model_config.lora:
      raise ExportError(f"{workdir} trained the full model (model.lora.rank=0): there is no adapter to "
                        "export as peft; use --format=hf")
    note = write_peft(model_config, params, out, base_model=config.model.get("hf_path") or "")
  else:
    write_orbax(model_config, params, out)
    note = ""
  return {"format": fmt, "step": step, "out": out, "files": sorted(paths.listdir(out)), "note": note}


def write_hf(model_config, params, out: str, *, tokenizer_dir=None) -> None:
  """``models.export_hf`` into ``out``; a remote ``out`` gets a local export copied up
  (``models.export_hf`` writes local files only)."""
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  if not paths.is_remote(out):
    models.export_hf(model_config, params, out, tokenizer_dir=tokenizer_dir)
    return
  with tempfile.TemporaryDirectory(prefix="asyncrl_jax_export_") as tmp:
    models.export_hf(model_config, params, tmp, tokenizer_dir=tokenizer_dir)
    paths.copy_tree(tmp, out)


def write_peft(model_config, params, out: str, *, base_model: str = "") -> str:
  """``models.export_peft`` into ``out`` (a remote ``out`` through a local copy). Without
  ``base_model`` (a run that did not start from a checkpoint) the base is written to ``out/base``
  and named. Returns a note on the base."""
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.models import lora  # pylint: disable=import-outside-toplevel

  def write(local: str, named: str) -> None:
    if not base_model:
      models.export_hf(*lora.base_model(model_config, params), paths.join(local, "base"))
    models.export_peft(model_config, params, local, base_model=base_model or named)

  if not paths.is_remote(out):
    write(out, paths.absolute(paths.join(out, "base")))
  else:
    with tempfile.TemporaryDirectory(prefix="asyncrl_jax_export_") as tmp:
      write(tmp, paths.join(out, "base"))
      paths.copy_tree(tmp, out)
  if base_model:
    return f"the adapters' base is {base_model} (the run's model.hf_path)"
  return "the run did not start from a checkpoint: its base weights are in base/ (Hugging Face layout)"


def write_orbax(model_config, params, out: str) -> None:
  """``out/params`` (a params-only Orbax checkpoint) and ``out/model_config.json``."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  paths.makedirs(out)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(paths.join(paths.absolute(out), "params"), params)
  ckpt.wait_until_finished()
  paths.write_text(paths.join(out, "model_config.json"),
                   json.dumps(dataclasses.asdict(model_config), indent=2, default=str))


def _is_orbax_export(path: str) -> bool:
  return paths.exists(paths.join(path, "model_config.json")) and paths.isdir(paths.join(path, "params"))


@contextlib.contextmanager
def local_export(path: str) -> Iterator[str]:
  """``path``, or for a remote Hugging Face export a temporary local copy of it (its readers,
  ``models.load_hf`` and the tokenizer, read local files only); Orbax reads remote exports itself."""
  if not paths.is_remote(path) or _is_orbax_export(path):
    yield path
    return
  with paths.local_dir(path) as local:
    yield local


def load_export(path: str, *, max_seq_len=None):
  """``(model_config, params)`` of an export in either format (told apart by its files)."""
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  if _is_orbax_export(path):
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    described = json.loads(paths.read_text(paths.join(path, "model_config.json")))
    if max_seq_len is not None:
      described["max_seq_len"] = max_seq_len
    params = ocp.StandardCheckpointer().restore(paths.join(paths.absolute(path), "params"))
    return models.ModelConfig.from_mapping(described), params
  if paths.exists(paths.join(path, "config.json")):
    with local_export(path) as local:
      return models.load_hf(local, max_seq_len=max_seq_len)
  raise ExportError(f"{path} holds neither an Orbax export (model_config.json + params/) nor a Hugging "
                    "Face one (config.json + safetensors)")


def main(argv=None) -> None:
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  # (defined here, not at import: serve imports load_export and has flags of its own)
  workdir = flags.DEFINE_string("workdir", None, "The run's directory (holds config.json and checkpoints/).")
  step = flags.DEFINE_integer("step", None, "Checkpoint step (policy version) to export; default the newest.")
  fmt = flags.DEFINE_enum("format", "hf", list(FORMATS), "Export format.")
  out = flags.DEFINE_string("out", None, "Output directory (created; must be empty if it exists).")

  def _main(args):
    if len(args) > 1:
      raise app.UsageError(f"unexpected arguments: {args[1:]}")
    if not workdir.value or not out.value:
      print("error: --workdir and --out are required", file=sys.stderr)
      sys.exit(2)
    try:
      result = export(workdir.value, out.value, fmt=fmt.value, step=step.value)
    except ExportError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    print(f"exported policy version {result['step']} of {workdir.value} as {result['format']} to "
          f"{result['out']}: {', '.join(result['files'])}")
    if result["note"]:
      print(f"note: {result['note']}")

  app.run(_main, argv=argv, flags_parser=cli.parse_flags)


if __name__ == "__main__":
  main()

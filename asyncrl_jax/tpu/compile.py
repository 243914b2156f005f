"""Every per-step program of a config, compiled by the TPU compiler for the slices it would run on,
on a machine without a TPU (``python -m asyncrl_jax info --compile``).

The learner's mesh is built over the devices of ``jax.experimental.topologies``' description of the
learner slice, and one decode server's over one host of the rollout slice, by the main job's own code
(``sharding.make_mesh``, ``Learner``, ``engine_from_config``) from shapes only: the programs are the
ones the job runs (same shardings, donation, remat, chunking), lowered from ``jax.ShapeDtypeStruct``
arguments and compiled by libtpu. Nothing is allocated.

Per program: the compiler's bytes per chip (arguments + outputs + temporaries - aliased), FLOPs and
bytes accessed per chip (XLA's, corrected for loops: ``hlo``), the roofline time
(``max(FLOPs / peak, bytes / HBM bandwidth)``, ``chips.CHIPS``), and its collectives. A role fits when
its largest program, plus what stays resident beside it (the optimizer state and gradient sum during
a gradient step, the version's batch throughout), leaves the config's margin of HBM free.

These are the compiler's projections, not measurements on a TPU.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Callable, Optional

GiB = 2**30

# libtpu reads these when it loads; set, they keep it from probing for TPU hardware and metadata
# servers on a machine that has neither (each unset one costs a warning on stderr), and let several
# processes (test workers, a second compile) load it at once: it locks a file otherwise.
_QUIET = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5p-8", "TPU_WORKER_HOSTNAMES": "localhost"}

INSTALL_HINT = ("the TPU compiler (libtpu) is not installed: `bash launch/setup.sh --tpu-compile` "
                "installs the version jax pins (requirements-tpu.txt), or "
                "`pip install -r requirements-tpu.txt`")


class LibtpuMissing(RuntimeError):
  """libtpu is not installed (the message says how to install it)."""


def require_libtpu() -> None:
  """Raises ``LibtpuMissing`` unless libtpu can be imported."""
  try:
    import libtpu  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise LibtpuMissing(INSTALL_HINT) from None


@contextlib.contextmanager
def _quiet_libtpu():
  """libtpu's hardware probing quieted while it describes a topology, and the environment restored
  afterwards: left set, ``TPU_WORKER_HOSTNAMES`` would tell a process started later from this one
  (a main job) that it runs on a TPU VM."""
  before = {key: os.environ.get(key) for key in _QUIET}
  for key, value in _QUIET.items():
    os.environ.setdefault(key, value)
  try:
    yield
  finally:
    for key, value in before.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value


def topology_devices(kind: str, chips: int) -> list:
  """The devices of a ``kind`` slice of ``chips`` chips (``chips.topology_name``), compile-only."""
  require_libtpu()
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tpu.chips import topology_name  # pylint: disable=import-outside-toplevel
  with _quiet_libtpu():
    return list(topologies.get_topology_desc(topology_name=topology_name(kind, chips),
                                             platform="tpu").devices)


def per_device_bytes(tree) -> int:
  """Bytes one device holds of a tree of ``jax.ShapeDtypeStruct`` (with shardings) or arrays."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return int(total)


def compile_program(name: str, fn, args, chip, mesh=None) -> dict:
  """Lowers and compiles ``fn(*args)``; the compiler's memory, cost and collectives per chip.

  Lowered under ``mesh`` (the topology's): a Pallas kernel's lowering reads the device kind from the
  mesh in context, which would otherwise be this machine's CPU."""
  import jax  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tpu import hlo  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  try:
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
      lowered = fn.lower(*args)
    compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except
    if "RESOURCE_EXHAUSTED" not in str(e) and "Ran out of memory" not in str(e):
      raise
    return _refused(name, str(e), time.perf_counter() - t0)
  seconds = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  xla = compiled.cost_analysis() or {}
  if isinstance(xla, list):  # (older jax: one dict per device program)
    xla = xla[0] if xla else {}
  cost = hlo.analyze(compiled.as_text())
  xla_flops, xla_bytes = float(xla.get("flops", 0.0)), float(xla.get("bytes accessed", 0.0))
  # XLA's figures with each loop counted as often as it runs (the walker's ratio); the walker's own
  # where XLA gives none
  flops = xla_flops * cost.flops / cost.flops_once if cost.flops_once and xla_flops else cost.flops
  traffic = xla_bytes * cost.bytes / cost.bytes_once if cost.bytes_once and xla_bytes else cost.bytes
  # Pallas kernels, which neither figure sees inside, at their analytic cost (tpu.kernels)
  flops += cost.kernel_flops
  traffic += cost.kernel_bytes
  roofline = max(flops / chip.bf16_flops, traffic / chip.hbm_bandwidth)
  compiled_bytes = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                    + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
  return {
      "name": name, "compiled_bytes": int(compiled_bytes),
      "memory": {"arguments": int(mem.argument_size_in_bytes), "outputs": int(mem.output_size_in_bytes),
                 "temporaries": int(mem.temp_size_in_bytes), "aliased": int(mem.alias_size_in_bytes),
                 "code": int(mem.generated_code_size_in_bytes)},
      "flops": flops, "bytes_accessed": traffic, "xla_flops": xla_flops, "xla_bytes_accessed": xla_bytes,
      "loops": [[n, t] for n, t in cost.loops], "roofline_seconds": roofline,
      "kernels": {"calls": cost.kernels, "flops": cost.kernel_flops, "bytes": cost.kernel_bytes,
                  "reread_bytes": cost.kernel_reread_bytes,
                  "paged_flops": cost.paged_flops, "paged_bytes": cost.paged_bytes},
      "bound": "compute" if flops / chip.bf16_flops >= traffic / chip.hbm_bandwidth else "memory",
      "collectives": cost.collectives, "compile_seconds": round(seconds, 1),
  }


def _refused(name: str, message: str, seconds: float) -> dict:
  """A program the compiler refused for want of HBM: the bytes it said it needs (at least)."""
  import re  # pylint: disable=import-outside-toplevel
  needed = re.search(r"required for HLO temporaries \(([\d.]+)([KMGT])\)", message)
  scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
  need = int(float(needed.group(1)) * scale[needed.group(2)]) if needed else 0
  line = next((l for l in message.splitlines() if "Ran out of memory" in l), message.splitlines()[-1])
  return {"name": name, "compiled_bytes": need, "refused": line.strip()[:400],
          "memory": {"temporaries": need}, "flops": 0.0, "bytes_accessed": 0.0, "xla_flops": 0.0,
          "xla_bytes_accessed": 0.0, "loops": [], "roofline_seconds": 0.0, "bound": "-",
          "collectives": {}, "compile_seconds": round(seconds, 1)}


def learner_programs(config, model_config, devices, *, row_len: Optional[int] = None):
  """The learner built from shapes on ``devices``, and ``(name, fn, args, resident_outside)`` of each
  program a version runs: ``resident_outside`` is what the role holds beside the program that is not
  among its arguments (bytes per chip)."""
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.infra import bucketing
  from asyncrl_jax.tpu import memory
  from asyncrl_jax.infra import sharding
  import jax  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.learner.learner import Learner  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh(devices, config.mesh.learner.to_dict(), role="mesh.learner")
  learner = Learner(model_config, models.abstract_params(model_config), mesh, config,
                    versions=int(config.steps))
  longest = int(config.data.max_prompt_len) + int(config.data.max_completion_len)
  row_len = row_len or bucketing.bucket(min(longest, model_config.max_seq_len), bucketing.ROW_BUCKETS)
  row_len = min(row_len, int(config.learner.token_budget))
  rows = sharding.batch_ways(mesh)
  resident = [learner.params, learner.opt_state]
  if learner.critic is not None:
    resident += [learner.critic.params, learner.critic.opt_state]
  batch = memory.version_batch(config, rows)
  out = []
  for name, fn, args in learner.programs(row_len):
    given = {id(x) for x in jax.tree.leaves(args)}
    # what the role holds beside the program: its state that the program does not take, the
    # version's batch (all its micro-batches are placed before the first update), and during a
    # gradient step the running sum of the earlier micro-batches' gradients
    extra = sum(per_device_bytes(r) for r in resident
                if not any(id(x) in given for x in jax.tree.leaves(r))) + batch
    if "grad_step" in name:
      extra += per_device_bytes(args[0])
    out.append((name, fn, args, int(extra)))
  return learner, row_len, out


def decode_programs(config, model_config, devices, *, shapes: str = "covering",
                    steps_per_call: int = 16):
  """One decode server's mesh on ``devices`` (one host), and ``(name, fn, args, 0)`` of its engine's
  programs (``Engine.programs``, built from shapes): its parameters and decode state are arguments
  of each."""
  from asyncrl_jax.infra import sharding  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.rollout.engine import engine_from_config  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh(devices, config.mesh.rollout.to_dict(), role="mesh.rollout")
  engine = engine_from_config(config, mesh, model_config)
  return mesh, [(n, f, a, 0) for n, f, a in engine.programs(steps_per_call, shapes)]


def compile_role(role: str, accelerator: str, programs: list, estimates: dict, margin: float,
                 progress: Callable[[str], None], mesh=None) -> dict:
  """Compiles ``programs`` (lowered under ``mesh``) for one chip of ``accelerator``; the role's
  report."""
  from asyncrl_jax.tpu import chips  # pylint: disable=import-outside-toplevel
  chip, n = chips.parse(accelerator)
  results = []
  for i, (name, fn, args, outside) in enumerate(programs):
    progress(f"[compile] {role} {i + 1}/{len(programs)}: {name} ...")
    r = compile_program(name, fn, args, chip, mesh)
    r["resident_outside_bytes"] = outside
    r["peak_bytes"] = r["compiled_bytes"] + outside
    r["estimate_bytes"] = estimates.get(name)
    results.append(r)
    if r.get("refused"):
      progress(f"[compile] {role} {name}: REFUSED by the compiler: {r['refused']}")
      continue
    progress(f"[compile] {role} {name}: {r['compiled_bytes'] / GiB:.2f} GiB compiled"
             + (f" (estimate {r['estimate_bytes'] / GiB:.2f})" if r["estimate_bytes"] else "")
             + f", peak with resident state {r['peak_bytes'] / GiB:.2f} GiB, "
             f"{r['flops']:.3g} FLOPs, roofline {r['roofline_seconds'] * 1e3:.2f} ms "
             f"({r['compile_seconds']:.0f} s to compile)")
  refused = [r for r in results if r.get("refused")]
  peak = refused[0] if refused else max(results, key=lambda r: r["peak_bytes"])
  usable = (1 - margin) * chip.hbm_bytes
  return {"accelerator": accelerator, "chip": chip.kind, "chips": n, "hbm_bytes": chip.hbm_bytes,
          "margin": margin, "peak_bytes": peak["peak_bytes"], "peak_program": peak["name"],
          "fits": not refused and peak["peak_bytes"] <= usable, "programs": results}


def compile_config(config, accelerator: str, rollout_accelerator: str = "", *, margin: float = 0.2,
                   shapes: str = "covering", roles: tuple = ("learner", "rollout"),
                   progress: Callable[[str], None] = print) -> dict:
  """Compiles every per-step program of ``roles`` of ``config``; the report (``info --json``), with
  the projection when both roles are compiled."""
  unknown = set(roles) - {"learner", "rollout"}
  if unknown or not roles:
    raise ValueError(f"roles={roles}: name 'learner', 'rollout' or both")
  require_libtpu()
  import jax  # pylint: disable=import-outside-toplevel
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tpu import memory
  from asyncrl_jax.tpu import chips, projection  # pylint: disable=import-outside-toplevel
  m = models.config_of(config)
  rollout_accelerator = rollout_accelerator or accelerator
  lchip, ln = chips.parse(accelerator)
  rchip, _ = chips.parse(rollout_accelerator)
  host = chips.host_chips(rollout_accelerator)
  estimates = memory.program_estimates(config, m, ln, host)
  out = {}
  if "learner" in roles:
    learner, row_len, programs = learner_programs(config, m, topology_devices(lchip.kind, ln))
    out["learner"] = compile_role("learner", accelerator, programs, estimates["learner"], margin,
                                  progress, learner.mesh)
    out["learner"]["row_len"] = row_len
    # a record projects with its own micro-batch and split, not today's config's
    out["learner"]["token_budget"] = int(config.learner.token_budget)
    out["learner"]["rollout_fraction"] = float(config.mesh.rollout_fraction)
  if "rollout" in roles:
    mesh, programs = decode_programs(config, m, topology_devices(rchip.kind, host), shapes=shapes)
    out["rollout"] = compile_role("rollout", f"{rchip.kind}-{host * rchip.cores_in_name}", programs,
                                  estimates["rollout"], margin, progress, mesh)
    out["rollout"]["slice"] = rollout_accelerator
  complete = len(out) == 2 and all(r["fits"] for r in out.values())
  return {"model_parameters": m.num_params, "jax": jax.__version__,
          "libtpu": metadata.version("libtpu"), "shapes": shapes, "roles": out,
          "projection": projection.project(config, m, out) if complete else None}


def report_lines(report: dict) -> list[str]:
  """The report as a table per role and the projection."""
  out = [f"TPU compiler (libtpu {report['libtpu']}, jax {report['jax']}): compiler projections, "
         "not measurements"]
  for role, r in report["roles"].items():
    out.append(f"{role}: {r['accelerator']} ({r['chips']} {r['chip']} chips), HBM "
               f"{r['hbm_bytes'] / GiB:.1f} GiB per chip, margin {r['margin']:.0%}")
    out.append(f"  {'program':<28} {'compiled':>9} {'estimate':>9} {'+resident':>9} {'TFLOPs':>8} "
               f"{'GB moved':>8} {'roofline':>10}  collectives")
    for p in r["programs"]:
      est = f"{p['estimate_bytes'] / GiB:9.2f}" if p["estimate_bytes"] else f"{'-':>9}"
      coll = ", ".join(f"{k} {v['count']}" for k, v in p["collectives"].items()) or "none"
      out.append(f"  {p['name']:<28} {p['compiled_bytes'] / GiB:9.2f} {est} "
                 f"{p['peak_bytes'] / GiB:9.2f} {p['flops'] / 1e12:8.2f} "
                 f"{p['bytes_accessed'] / 1e9:8.2f} {p['roofline_seconds'] * 1e3:8.2f}ms  {coll}")
    out.append(f"  {'fits' if r['fits'] else 'DOES NOT FIT'}: {r['peak_program']} at "
               f"{r['peak_bytes'] / GiB:.2f} GiB (GiB per chip; +resident: with the role's state "
               "held beside the program)")
  p = report["projection"]
  if p is None:
    return out
  out.append(f"projection: learner {p['learner_tokens_per_s']:,.0f} tokens/s (MFU {p['learner_mfu']:.1%}); "
             f"decode {p['decode_tokens_per_s']:,.0f} tokens/s per server, its step "
             f"{p['decode_step_over_live_roofline']:.2f}x the live-cache roofline; async/sync "
             f"{p['async_over_sync']:.2f}x on the config's {p['learner_chips']} learner + "
             f"{p['rollout_chips']} rollout chips ({p['lengths']}; sync: {p['sync_baseline']})")
  best = p["planner_best"]
  if best:
    out.append(f"planner: best split {best['learner_chips']} learner + {best['rollout_chips']} rollout "
               f"chips at eta {best['eta']}: {best['over_sync']:.2f}x synchronous RL")
  return out

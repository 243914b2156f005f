"""Where a decode step's bytes go: each shipped TPU config's decode chunk compiled for one host of its
rollout slice (as ``tpu_compile.py`` does), its traffic broken down by instruction, and its step time
against the live-cache roofline counted two ways.

  .venv/bin/python benchmarks/decode_bytes.py [--configs qwen2_5_1_5b.py ...]

* **XLA's count** (what ``tpu_compile`` projects with): XLA's ``bytes accessed`` with loops counted,
  plus the paged kernel's analytic bytes at the live share of the cache. XLA's figure counts every
  operand and result whatever memory it is in: when the compiler prefetches a weight into the chip's
  on-chip VMEM (an asynchronous ``copy-start`` into memory space ``S(1)``), it counts the copy's read,
  its write into VMEM, and the matrix product's read of the VMEM copy.
* **HBM only** (``tpu.hlo``'s walker, ``Cost.hbm``): each top-level instruction's operands and result
  that live in HBM (no ``S(n)`` memory space other than 0), an in-place update (the KV cache's scatter)
  as the bytes it updates, an asynchronous copy once; the same kernel bytes. The embedding's gather is
  still charged its whole table (an upper bound: a gather of one row per slot reads far less).

Both are compiler figures for a chip no one ran here, not measurements. Writes
benchmarks/results/decode_bytes.{json,md}; prints one JSON object (last line).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402  pylint: disable=wrong-import-position

CONFIGS = ("qwen2_5_1_5b.py", "qwen2_5_1_5b_v6e.py", "r1_distill_qwen_7b_v5p.py")
STEPS_PER_CALL = 16
NOTES = """Each shipped config's decode chunk (16 steps) compiled for one host of its rollout slice, its
step time at the live share of the cache counted two ways. **XLA's count** (what `tpu_compile` projects
with): XLA's `bytes accessed` with loops counted, plus the paged kernel's analytic bytes. It counts
every operand and result in whatever memory it lives: a weight the compiler prefetches into the chip's
on-chip VMEM (an asynchronous copy into memory space `S(1)`) is counted at its read, at its write into
VMEM and again at the product's read of the VMEM copy. **HBM only** (`tpu.hlo`'s walker, `Cost.hbm`):
the operands and results that live in HBM, an in-place update (the KV cache's write) as the bytes it
updates, a prefetch once; the same kernel bytes. The embedding's gather is still charged its whole
table (an upper bound). Live roofline: the serving weights once plus each slot's KV cache up to the
live context of the seed's length distribution, over HBM bandwidth (`tpu.projection.decode_live_step`);
the target is a step within 1.3x of it. Compiler figures for chips no one ran here, not measurements."""


def _group(op_name: str) -> str:
  """An instruction's JAX operation with the layer index folded (``layer_*``)."""
  name = re.sub(r"layer_\d+", "layer_*", op_name.split("while/body/")[-1]).removeprefix("Transformer/")
  if "ragged_paged_attention" in name:
    return "layer_*/attn/ragged_paged_attention kernel"
  return name or "(compiler-made)"


def measure(name: str, lora_rank: int = 0, weight_dtype: str = "") -> dict:
  """The decode chunk's bytes of config ``name``; ``lora_rank``: with LoRA adapters of that rank
  (every target), applied unmerged as the decode servers do; ``weight_dtype``: the servers'
  ``rollout.weight_dtype`` (e.g. "int8")."""
  import jax  # pylint: disable=import-outside-toplevel
  from asyncrl_jax import config as config_lib, models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tpu import chips, compile as tpu_compile, hlo, projection  # pylint: disable=import-outside-toplevel
  module = config_lib.config_module(name, beside=os.path.join(ROOT, "configs", name))
  config = module.get_config()
  if lora_rank:
    config.model.lora.rank = lora_rank
  config.rollout.weight_dtype = weight_dtype
  config = config_lib.validate(config)
  accelerator = module.ACCELERATORS["rollout"]
  m = models.config_of(config)
  chip, _ = chips.parse(accelerator)
  host = chips.host_chips(accelerator)
  mesh, programs = tpu_compile.decode_programs(config, m, tpu_compile.topology_devices(chip.kind, host),
                                               steps_per_call=STEPS_PER_CALL)
  program, fn, args, _ = next(p for p in programs if p[0].startswith("decode_chunk"))
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = fn.lower(*args).compile()
  seconds = time.perf_counter() - t0
  text = compiled.as_text()
  cost = hlo.analyze(text)
  xla = compiled.cost_analysis() or {}
  xla = xla[0] if isinstance(xla, list) else xla
  xla_bytes = float(xla.get("bytes accessed", 0.0)) * cost.bytes / cost.bytes_once + cost.kernel_bytes
  _, sequences = projection.seed_sequences(config)
  context = projection.live_context(sequences, int(config.data.max_prompt_len) / 2)
  cache_len = int(config.data.max_prompt_len) + int(config.data.max_completion_len)
  unread = cost.paged_bytes * (1 - context / cache_len)  # the cache beyond each slot's position
  live = projection.decode_live_step(config, m, chip, server_chips=host, context=context)
  per_step = lambda total: (total - unread) / STEPS_PER_CALL
  groups = collections.Counter()
  for row in hlo.breakdown(text, top=len(cost.by_instruction)):
    groups[_group(row["op_name"]) + " (" + row["opcode"] + ")"] += row["bytes"]
  kernel = "ragged_paged_attention"
  top = []
  for what, moved in groups.most_common(8):
    if kernel in what:  # at the live share, as the step is counted
      moved -= unread
    top.append({"operation": what, "gb_per_step": moved / STEPS_PER_CALL / 1e9})
  out = {
      "config": name, "accelerator": f"{chip.kind}-{host * chip.cores_in_name}", "program": program,
      "compile_seconds": round(seconds, 1), "live_context": context, "cache_length": cache_len,
      "live_roofline": {"weights_gb": live["weights_bytes"] / 1e9, "kv_gb": live["live_kv_bytes"] / 1e9,
                        "ms": live["seconds"] * 1e3},
      "xla": {"gb_per_step": per_step(xla_bytes) / 1e9,
              "ms": per_step(xla_bytes) / chip.hbm_bandwidth * 1e3},
      "hbm_only": {"gb_per_step": per_step(cost.hbm) / 1e9,
                   "ms": per_step(cost.hbm) / chip.hbm_bandwidth * 1e3},
      "top": top,
  }
  out["xla"]["over_live"] = out["xla"]["ms"] / out["live_roofline"]["ms"]
  out["hbm_only"]["over_live"] = out["hbm_only"]["ms"] / out["live_roofline"]["ms"]
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
  args = p.parse_args(argv)
  from asyncrl_jax.tpu import compile as tpu_compile  # pylint: disable=import-outside-toplevel
  tpu_compile.require_libtpu()
  rows, records = [], []
  for name in args.configs:
    print(f"[decode_bytes] compiling {name}'s decode chunk ...", flush=True)
    r = measure(name)
    records.append(r)
    rows.append([name, r["accelerator"], f"{r['live_roofline']['weights_gb']:.2f} + {r['live_roofline']['kv_gb']:.2f}",
                 f"{r['live_roofline']['ms']:.2f}", f"{r['xla']['gb_per_step']:.2f}", f"{r['xla']['ms']:.2f}",
                 f"{r['xla']['over_live']:.2f}x", f"{r['hbm_only']['gb_per_step']:.2f}",
                 f"{r['hbm_only']['ms']:.2f}", f"{r['hbm_only']['over_live']:.2f}x"])
    print(json.dumps(r), flush=True)
  tops = []
  for r in records:
    tops += [f"* {r['config']}, HBM only, per step: " + "; ".join(
        f"{t['operation']} {t['gb_per_step']:.2f} GB" for t in r["top"][:6])]
  notes = NOTES + "\n\nThe largest contributors (HBM only, per step):\n\n" + "\n".join(tops)
  result = {"machine": common.machine(), "commit": common._commit(),  # pylint: disable=protected-access
            "config": {"configs": args.configs, "steps_per_call": STEPS_PER_CALL}, "records": records}
  common.write_result("decode_bytes", result,
                      ["config", "slice", "live roofline GB (weights + KV)", "live roofline ms",
                       "XLA's count GB", "XLA's count ms", "XLA / live", "HBM-only GB", "HBM-only ms",
                       "HBM-only / live"], rows, notes=notes)
  print(json.dumps({"decode_bytes": [{k: r[k] for k in ("config", "xla", "hbm_only")} for r in records]}))
  return 0


if __name__ == "__main__":
  sys.exit(main())

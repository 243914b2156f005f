"""int8 decode servers (``rollout.weight_dtype="int8"``) against the serving dtype, by decode speed.

  .venv/bin/python benchmarks/int8_rollout.py [--quick] [--no-tpu]

* **TPU compile** (libtpu, as ``decode_bytes.py``): each shipped config's decode chunk with bfloat16
  and with int8 weights: HBM-only bytes and roofline milliseconds per step, and the tokens per second
  of one decode server they project (its slots / the step's time). Compiler figures, not
  measurements.
* **CPU** (this machine): the fused decode loop of ``engine_throughput`` (the engine's own step, 32
  slots, temperature 1) on the default model, float32 weights against int8, interleaved rounds. The
  CPU has no int8 matrix path here: the kernels are dequantized in the program, so this measures the
  cost of that, not a gain.

Whether learning survives the mismatch is the staleness grid's business (``--config.rollout.weight_dtype
=int8`` in ``staleness_ablation.py``). Writes benchmarks/results/int8_rollout.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from asyncrl_jax import cli  # noqa: E402  pylint: disable=wrong-import-position

cli.ensure_cpu_devices(1)

from benchmarks import common  # noqa: E402  pylint: disable=wrong-import-position
from benchmarks.lora_serving import interleaved  # noqa: E402
from benchmarks.shapes import model_config  # noqa: E402


def tpu(configs) -> list:
  from asyncrl_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from benchmarks import decode_bytes  # pylint: disable=import-outside-toplevel
  out = []
  for name in configs:
    print(f"[int8_rollout] compiling {name}'s decode chunk in bfloat16 and in int8 ...", flush=True)
    module = config_lib.config_module(name, beside=os.path.join(ROOT, "configs", name))
    slots = int(module.get_config().rollout.num_slots)
    bf16, int8 = decode_bytes.measure(name), decode_bytes.measure(name, weight_dtype="int8")
    row = {"config": name, "accelerator": bf16["accelerator"], "slots": slots}
    for kind, r in (("bf16", bf16), ("int8", int8)):
      row[kind] = dict(r["hbm_only"], tokens_per_s=slots / (r["hbm_only"]["ms"] / 1e3))
    row["speedup"] = bf16["hbm_only"]["ms"] / int8["hbm_only"]["ms"]
    out.append(row)
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--rounds", type=int, default=None)
  p.add_argument("--no-tpu", action="store_true", help="skip the TPU compile (CPU only)")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  rounds = args.rounds or (4 if args.quick else 8)
  plain = model_config("demo", dtype="float32", param_dtype="float32")
  cpu = interleaved({"float32": (plain, {}), "int8": (plain, {"weight_dtype": "int8"})}, rounds, 96)
  result = {"benchmark": "int8_rollout", "machine": common.machine(),
            "config": {"rounds": rounds, "cpu_model": "demo (configs/default.py's)", "new_tokens": 96,
                       "slots": 32},
            "cpu": cpu}
  rows = [["CPU fused decode loop (demo model), tokens/s", f"{cpu['tokens_per_s']['float32']:,.0f}",
           f"{cpu['tokens_per_s']['int8']:,.0f}", f"{cpu['tokens_per_s']['int8'] / cpu['tokens_per_s']['float32']:.3f}"]]
  if not args.no_tpu:
    from asyncrl_jax.tpu import compile as tpu_compile  # pylint: disable=import-outside-toplevel
    from benchmarks.decode_bytes import CONFIGS  # pylint: disable=import-outside-toplevel
    tpu_compile.require_libtpu()  # (says how to install it; --no-tpu skips this part)
    result["tpu"] = tpu(CONFIGS)
    for r in result["tpu"]:
      rows.append([f"{r['config']} ({r['accelerator']}, {r['slots']} slots): GB / ms per step, tokens/s",
                   f"{r['bf16']['gb_per_step']:.2f} / {r['bf16']['ms']:.2f} / {r['bf16']['tokens_per_s']:,.0f}",
                   f"{r['int8']['gb_per_step']:.2f} / {r['int8']['ms']:.2f} / {r['int8']['tokens_per_s']:,.0f}",
                   f"{r['speedup']:.3f}"])
  notes = ("Decode servers with int8 projection kernels (per output channel, bfloat16 scales; embedding, "
           "norms and the KV cache unchanged) against the serving dtype. TPU: the compiled decode chunk's "
           "HBM-only bytes and roofline time per step and one server's projected tokens/s (compiler "
           "figures, no TPU ran them); ratio = bf16 time / int8 time (> 1: int8 faster). CPU: fused "
           f"decode loop tokens/s, median of {rounds} interleaved rounds (float32 weights; ratio int8 / "
           "float32): the kernels are dequantized in the program, there is no int8 product on this CPU.")
  kwargs = {"out_dir": args.out} if args.out else {}
  path = common.write_result("int8_rollout", result, ["measure", "serving dtype", "int8", "ratio"], rows,
                             notes, **kwargs)
  print(json.dumps({"cpu_int8_over_float32": cpu["tokens_per_s"]["int8"] / cpu["tokens_per_s"]["float32"],
                    "tpu": [(r["config"], r["speedup"]) for r in result.get("tpu", [])]}))
  print(f"[int8_rollout] wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

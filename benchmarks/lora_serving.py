"""LoRA on the decode servers: adapters applied unmerged against a merged serving copy, by decode speed.

  .venv/bin/python benchmarks/lora_serving.py [--quick] [--rank 8] [--no-tpu]

A decode server of a LoRA run holds the frozen base and the adapters. It can apply the adapters
unmerged (two thin products beside each target projection: what the model does, and what a server
that pulls adapters alone needs no extra memory for), or fold them into a serving copy of the weights
at each update (then a decode step is the plain model's, at the cost of a second copy of every target
weight and a merge per version). A merged copy decodes exactly like the model without adapters, so
the plain model's step stands for it here:

* **CPU** (this machine): the fused decode loop of ``engine_throughput`` (the engine's own step, 32
  slots, temperature 1, the default model), plain against LoRA rank ``--rank`` on every target,
  interleaved rounds; ratio = unmerged / merged tokens per second.
* **TPU compile** (libtpu, as ``decode_bytes.py``): each shipped config's decode chunk with and
  without adapters; HBM-only bytes and roofline milliseconds per step.

Writes benchmarks/results/lora_serving.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from asyncrl_jax import cli  # noqa: E402  pylint: disable=wrong-import-position

cli.ensure_cpu_devices(1)

import jax  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.shapes import model_config  # noqa: E402


def _fused_loop(config, new_tokens: int, slots: int = 32, **engine_kw):
  """(run, tokens per run): the engine's decode step ``new_tokens`` times for every slot, jitted."""
  from asyncrl_jax.infra import sharding  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.rollout import Engine, SamplingSettings  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh(jax.devices()[:1], dict(data=1, fsdp=1, tensor=1))
  engine = Engine(config, mesh=mesh, num_slots=slots, max_prefill_length=16,
                  max_target_length=1 << (8 + new_tokens - 1).bit_length(),
                  sampling=SamplingSettings(temperature=1.0), background_compile=False, **engine_kw)
  params = engine.load_params()
  prompts = np.zeros((slots, 8), np.int32)
  prompts[:, 0] = 1
  prompts[:, 1:] = np.random.default_rng(0).integers(3, config.vocab_size, (slots, 7))
  state = engine.refill(params, engine.init_decode_state(), prompts, np.full(slots, 8, np.int32))

  @jax.jit
  def loop(params, state):
    def body(i, carry):
      state, out = carry
      state, tokens, _ = engine._step_impl(params, state)  # pylint: disable=protected-access
      return state, out.at[:, i].set(tokens)
    return jax.lax.fori_loop(0, new_tokens, body, (state, jax.numpy.zeros((slots, new_tokens), jax.numpy.int32)))

  jax.block_until_ready(loop(params, state))  # compile
  return (lambda: jax.block_until_ready(loop(params, state))), slots * new_tokens


def interleaved(arms: dict, rounds: int, new_tokens: int) -> dict:
  """``arms``: name -> (model config, engine keyword arguments). Each arm's fused decode loop, run in
  alternating order for ``rounds`` rounds; tokens/s per arm (median) and every run's."""
  loops = {k: _fused_loop(config, new_tokens, **kw) for k, (config, kw) in arms.items()}
  runs = {k: [] for k in loops}
  for r in range(rounds):
    for k in (list(loops) if r % 2 == 0 else list(loops)[::-1]):
      run, tokens = loops[k]
      t = time.perf_counter()
      run()
      runs[k].append(tokens / (time.perf_counter() - t))
  return {"tokens_per_s": {k: float(np.median(v)) for k, v in runs.items()}, "runs": runs}


def cpu(rank: int, rounds: int, new_tokens: int) -> dict:
  plain = model_config("demo", dtype="float32", param_dtype="float32")
  out = interleaved({"merged": (plain, {}), "unmerged": (plain.replace(lora_rank=rank), {})}, rounds,
                    new_tokens)
  return dict(out, unmerged_over_merged=out["tokens_per_s"]["unmerged"] / out["tokens_per_s"]["merged"])


def tpu(rank: int, configs) -> list:
  from benchmarks import decode_bytes  # pylint: disable=import-outside-toplevel
  out = []
  for name in configs:
    print(f"[lora_serving] compiling {name}'s decode chunk without and with rank-{rank} adapters ...",
          flush=True)
    merged, unmerged = decode_bytes.measure(name), decode_bytes.measure(name, lora_rank=rank)
    out.append({"config": name, "accelerator": merged["accelerator"],
                "merged": merged["hbm_only"], "unmerged": unmerged["hbm_only"],
                "unmerged_over_merged_ms": unmerged["hbm_only"]["ms"] / merged["hbm_only"]["ms"]})
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--rank", type=int, default=8)
  p.add_argument("--rounds", type=int, default=None)
  p.add_argument("--no-tpu", action="store_true", help="skip the TPU compile (CPU only)")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  rounds = args.rounds or (4 if args.quick else 8)
  result = {"benchmark": "lora_serving", "machine": common.machine(),
            "config": {"rank": args.rank, "targets": "q,k,v,o,gate,up,down", "rounds": rounds,
                       "cpu_model": "demo (configs/default.py's)", "new_tokens": 96, "slots": 32},
            "cpu": cpu(args.rank, rounds, 96)}
  rows = [["CPU fused decode loop (demo model), tokens/s", f"{result['cpu']['tokens_per_s']['merged']:,.0f}",
           f"{result['cpu']['tokens_per_s']['unmerged']:,.0f}", f"{result['cpu']['unmerged_over_merged']:.3f}"]]
  from asyncrl_jax.tpu import compile as tpu_compile  # pylint: disable=import-outside-toplevel
  if not args.no_tpu:
    tpu_compile.require_libtpu()  # (says how to install it; --no-tpu skips this part)
    from benchmarks.decode_bytes import CONFIGS  # pylint: disable=import-outside-toplevel
    result["tpu"] = tpu(args.rank, CONFIGS)
    for r in result["tpu"]:
      rows.append([f"{r['config']} ({r['accelerator']}) decode step, HBM-only ms (GB)",
                   f"{r['merged']['ms']:.3f} ({r['merged']['gb_per_step']:.2f})",
                   f"{r['unmerged']['ms']:.3f} ({r['unmerged']['gb_per_step']:.2f})",
                   f"{r['unmerged_over_merged_ms']:.3f}"])
  notes = (f"Adapters of rank {args.rank} on every target applied unmerged by the decode step, against a "
           "merged serving copy (whose step is the plain model's). CPU: tokens/s of the fused decode loop, "
           f"median of {rounds} interleaved rounds (ratio: unmerged / merged, < 1 slower). TPU: the compiled "
           "decode chunk's HBM-only bytes and roofline time per step (compiler figures, no TPU ran them; "
           "ratio: unmerged / merged time, > 1 slower).")
  kwargs = {"out_dir": args.out} if args.out else {}
  path = common.write_result("lora_serving", result, ["measure", "merged (plain step)", "unmerged (LoRA)",
                                                      "ratio"], rows, notes, **kwargs)
  print(json.dumps({"cpu_unmerged_over_merged": result["cpu"]["unmerged_over_merged"],
                    "tpu": [(r["config"], r["unmerged_over_merged_ms"]) for r in result.get("tpu", [])]}))
  print(f"[lora_serving] wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Decode throughput: the RL decode server vs a bare fused jitted decode loop, same model and batch.

  .venv/bin/python benchmarks/engine_throughput.py --quick

* reference: one jitted ``lax.fori_loop`` that samples and decodes ``--new_tokens`` steps for all slots
  (the same sampling and cache code as the engine), tokens kept on device, no host round trips;
* engine: ``DecodeServer`` with continuous batching over the same engine: ``2 x slots`` requests,
  prefill + insert as slots free up, a host round trip per step for tokens, log-probs and versions.

Both sample at temperature 1 and never stop early, so both generate exactly ``new_tokens`` tokens per
request. Compilation is excluded (each arm runs once before timing). Also measured: the cost of one
interrupt (re-prefilling every busy slot under new weights) relative to one decode step: at one
context length for every slot, and at mixed lengths both as the engine does it (slots grouped by length)
and in one call that pads every slot to the longest.
Prints one JSON object (last line) and writes benchmarks/results/engine_throughput.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl_jax import cli  # noqa: E402  pylint: disable=wrong-import-position

cli.ensure_cpu_devices(1)

import jax  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402

from asyncrl_jax.infra import sharding  # noqa: E402
from asyncrl_jax.rollout import DecodeServer, Engine, RolloutRequest, SamplingSettings  # noqa: E402
from asyncrl_jax.tokenization import ArithmeticTokenizer  # noqa: E402
from benchmarks.common import machine, write_result  # noqa: E402
from benchmarks.shapes import SHAPES, model_config  # noqa: E402


class _NoStop(ArithmeticTokenizer):
  stop_ids = (-1,)


def _requests(n, new_tokens, rng):
  return [RolloutRequest(prompt_tokens=[1] + list(rng.integers(3, 17, 7)), max_new_tokens=new_tokens)
          for _ in range(n)]


def _engine_arm(engine, params, n_requests, new_tokens, seed, steps_per_call):
  server = DecodeServer(engine, params, steps_per_call=steps_per_call)
  server.submit(*_requests(n_requests, new_tokens, np.random.default_rng(seed)))
  t = time.perf_counter()
  server.run_until_idle()
  elapsed = time.perf_counter() - t
  tokens = sum(len(server.finished.get().completion_tokens) for _ in range(n_requests))
  return tokens / elapsed, server.stats


def _reference_arm(engine, params, new_tokens, rounds, seed):
  state = engine.init_decode_state()
  rng = np.random.default_rng(seed)
  prompts = np.zeros((engine.num_slots, 8), np.int32)
  prompts[:, 0] = 1
  prompts[:, 1:] = rng.integers(3, 17, (engine.num_slots, 7))
  state = engine.refill(params, state, prompts, np.full(engine.num_slots, 8, np.int32))

  @jax.jit
  def loop(params, state):
    def body(i, carry):
      state, out = carry
      state, tokens, logp = engine._step_impl(params, state)  # pylint: disable=protected-access
      return state, (out[0].at[:, i].set(tokens), out[1].at[:, i].set(logp))
    out = (jax.numpy.zeros((engine.num_slots, new_tokens), jax.numpy.int32),
           jax.numpy.zeros((engine.num_slots, new_tokens), jax.numpy.float32))
    return jax.lax.fori_loop(0, new_tokens, body, (state, out))

  jax.block_until_ready(loop(params, state))  # compile
  t = time.perf_counter()
  for _ in range(rounds):
    _, out = loop(params, state)
    jax.device_get(out)
  elapsed = time.perf_counter() - t
  return rounds * engine.num_slots * new_tokens / elapsed


def interrupt_cost(engine, params, lengths) -> tuple[float, float]:
  """Median seconds of one interrupt (re-prefill of every slot, slot ``i`` holding ``lengths[i]``
  tokens) and of one decode step, on ``engine`` with ``params``."""
  lengths = np.asarray(lengths, np.int32)
  state = engine.init_decode_state()
  tokens = np.full((engine.num_slots, int(lengths.max())), 5, np.int32)
  state = engine.refill(params, state, tokens, lengths)  # compile
  engine.wait_for_compiles()  # time the steady state: no compilation competing for the cores
  state, *_ = engine.step(params, state)
  jax.block_until_ready(state.logits)
  times = {"refill": [], "step": []}
  for _ in range(10):
    t = time.perf_counter()
    state = engine.refill(params, state, tokens, lengths)
    jax.block_until_ready(state.logits)
    times["refill"].append(time.perf_counter() - t)
    t = time.perf_counter()
    state, tok, lp = engine.step(params, state)
    jax.device_get((tok, lp))
    times["step"].append(time.perf_counter() - t)
  refill, step = float(np.median(times["refill"])), float(np.median(times["step"]))
  return refill, step


def mixed_lengths(slots: int, prompt_len: int, new_tokens: int, seed: int = 0) -> np.ndarray:
  """In-flight lengths as a weight update finds them: the prompt plus a uniform share of a heavy-tailed
  completion (lognormal, median 20 tokens, sigma 0.8, capped at ``new_tokens``)."""
  rng = np.random.default_rng(seed)
  full = np.minimum(np.floor(rng.lognormal(np.log(20), 0.8, slots)), new_tokens)
  return (prompt_len + np.floor(rng.random(slots) * full)).astype(np.int32)


def grouped_vs_one_call(engine, params, lengths) -> dict:
  """Interrupt cost at mixed lengths, in decode steps: the engine's length-grouped refill, and one call
  that pads every slot to the longest (``prefill_call_overhead`` so large that one call is cheapest)."""
  grouped_s, step_s = interrupt_cost(engine, params, lengths)
  overhead, engine.prefill_call_overhead = engine.prefill_call_overhead, 10**12
  try:
    one_call_s, one_call_step_s = interrupt_cost(engine, params, lengths)
  finally:
    engine.prefill_call_overhead = overhead
  return dict(grouped_steps=grouped_s / step_s, one_call_steps=one_call_s / one_call_step_s,
              grouped_speedup=one_call_s / grouped_s, mean_length=float(np.mean(lengths)),
              max_length=int(np.max(lengths)))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--slots", type=int, default=32)
  parser.add_argument("--new_tokens", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--steps_per_call", type=int, default=16, help="decode server chunk size")
  parser.add_argument("--model", default="demo", choices=sorted(SHAPES), help="model shape (random weights)")
  parser.add_argument("--dtype", default="float32", help="activation and parameter dtype")
  parser.add_argument("--name", default="engine_throughput", help="result file name")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  if args.quick:
    args.new_tokens, args.repeats = 96, 2

  config = model_config(args.model, dtype=args.dtype, param_dtype=args.dtype)
  mesh = sharding.make_mesh(jax.devices()[:1], dict(data=1, fsdp=1, tensor=1))
  max_target = 8 + args.new_tokens
  max_target = 1 << (max_target - 1).bit_length()
  engine = Engine(config, mesh=mesh, num_slots=args.slots, max_prefill_length=16,
                  max_target_length=max_target, sampling=SamplingSettings(temperature=1.0),
                  tokenizer=_NoStop())
  params = engine.load_params()
  engine.warm_up()  # every batched-prefill shape, as a decode server started with rollout.warm_up does
  engine.wait_for_compiles()

  _engine_arm(engine, params, args.slots, 8, seed=99, steps_per_call=args.steps_per_call)  # compile prefill buckets, insert, step
  engine_runs, reference_runs = [], []
  for r in range(args.repeats):  # interleaved so both arms see the same machine state
    tok_s, stats = _engine_arm(engine, params, 2 * args.slots, args.new_tokens, seed=r,
                               steps_per_call=args.steps_per_call)
    engine_runs.append(tok_s)
    reference_runs.append(_reference_arm(engine, params, args.new_tokens, 2, seed=r))
  refill_s, step_s = interrupt_cost(engine, params, np.full(args.slots, 8 + args.new_tokens // 2))
  mixed = grouped_vs_one_call(engine, params, mixed_lengths(args.slots, 8, args.new_tokens))
  engine_tok_s, reference_tok_s = float(np.median(engine_runs)), float(np.median(reference_runs))
  result = {
      "benchmark": "engine_throughput",
      "engine_tok_s": engine_tok_s,
      "reference_tok_s": reference_tok_s,
      "ratio": engine_tok_s / reference_tok_s,
      "interrupt_s": refill_s,
      "decode_step_s": step_s,
      "interrupt_cost_in_steps": refill_s / step_s,
      "interrupt_mixed": mixed,
      "slot_utilization": stats.tokens / stats.slot_steps,
      "engine_runs_tok_s": engine_runs,
      "reference_runs_tok_s": reference_runs,
      "machine": machine(),
      "config": {k: v for k, v in vars(args).items() if k != "out"} | {
          "model": f"{args.model}: {SHAPES[args.model]}", "cache_len": max_target,
          "sampling": "temperature 1", "interrupt_context": 8 + args.new_tokens // 2},
  }
  notes = (f"Decode server (continuous batching, per-token log-probs and versions) vs a fused jitted "
           f"decode loop of the same engine step: ratio **{result['ratio']:.2f}** (goal >= 0.9). One "
           f"interrupt (re-prefill of all {args.slots} slots at context {8 + args.new_tokens // 2}) costs "
           f"{result['interrupt_cost_in_steps']:.1f} decode steps. At mixed in-flight lengths (mean "
           f"{mixed['mean_length']:.0f}, longest {mixed['max_length']}) the length-grouped refill costs "
           f"{mixed['grouped_steps']:.1f} decode steps, one call padding every slot to the longest "
           f"{mixed['one_call_steps']:.1f} ({mixed['grouped_speedup']:.1f}x).")
  table = [["engine (DecodeServer)", engine_tok_s], ["reference (fused loop)", reference_tok_s],
           ["ratio", result["ratio"]], ["interrupt / decode step", result["interrupt_cost_in_steps"]],
           ["interrupt at mixed lengths, grouped / decode step", mixed["grouped_steps"]],
           ["interrupt at mixed lengths, one call / decode step", mixed["one_call_steps"]]]
  out_dir = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
  write_result(args.name, result, ["measure", "value"], table, notes, out_dir)
  _plot(result, os.path.join(out_dir, f"{args.name}.png"))
  print(json.dumps({k: result[k] for k in ("engine_tok_s", "reference_tok_s", "ratio",
                                           "interrupt_cost_in_steps", "interrupt_mixed",
                                           "slot_utilization")}))
  return result


def _plot(result, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(5, 3.2))
  ax.bar(["fused loop", "decode server"], [result["reference_tok_s"], result["engine_tok_s"]],
         color=["#999999", "#3366cc"])
  ax.set_ylabel("tokens / s")
  ax.set_title(f"Decode throughput (ratio {result['ratio']:.2f})")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


if __name__ == "__main__":
  main()

"""Learner throughput: trained tokens/s of one policy update (packed micro-batches + AdamW).

  .venv/bin/python benchmarks/learner_throughput.py --quick
  python benchmarks/learner_throughput.py --model qwen2.5-0.5b --dtype bfloat16 --batch 256   # accelerator

A global batch of ``--batch`` sequences (prompt 32 tokens + completion drawn from a capped lognormal) goes
through ``Learner.train`` exactly as in the main job (decoupled PPO, dynamic micro-batches under
``--token_budget``, ``--minibatches`` optimizer updates). Reported: policy tokens trained per second, all
tokens (prompt included) per second, and the achieved model FLOP/s (6 x params x tokens for the update,
plus 2 x params x tokens for the prox pass of every minibatch after the first; attention FLOPs left
out). Median of ``--repeats`` updates after one warm-up (compilation).

Beside it, the same batches' separate prox pass (one forward over every packed micro-batch) is timed:
the learner reads the first minibatch's prox log-probs off its own forward pass, and this column is what
that saves per update (a learner that always runs the prox pass would take update + prox pass).
Writes benchmarks/results/<name>.{json,md}.
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

from asyncrl_jax import models  # noqa: E402

from asyncrl_jax.config import base_config  # noqa: E402
from asyncrl_jax.infra import sharding
from asyncrl_jax.learner.learner import Learner  # noqa: E402
from asyncrl_jax.rl import batching  # noqa: E402
from asyncrl_jax.rl.logprobs import compute_logprobs  # noqa: E402
from benchmarks.common import machine, write_result  # noqa: E402
from benchmarks.packing import heavy_tailed_lengths, make_sequences  # noqa: E402
from benchmarks.shapes import SHAPES, model_config  # noqa: E402


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--model", default="demo", choices=sorted(SHAPES))
  p.add_argument("--dtype", default="float32")
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--token_budget", type=int, default=4096)
  p.add_argument("--minibatches", type=int, default=1, help="learner.ppo_minibatches")
  p.add_argument("--median", type=float, default=24.0, help="median completion length")
  p.add_argument("--sigma", type=float, default=0.8)
  p.add_argument("--cap", type=int, default=96)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--name", default="learner_throughput")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  if args.quick:
    args.repeats = 3
  mc = model_config(args.model, dtype=args.dtype, param_dtype=args.dtype)
  mesh = sharding.make_mesh(jax.devices()[:1], dict(data=1, fsdp=1, tensor=1))
  config = base_config()
  config.learner.update(batch_size=args.batch, token_budget=args.token_budget, learning_rate=1e-5,
                        ppo_minibatches=args.minibatches)
  params = models.init_params(mc, jax.random.key(0), mesh=mesh)
  n_params = models.count_params(params)
  learner = Learner(mc, params, mesh, config, versions=args.repeats + 1)
  del params
  rng = np.random.default_rng(0)
  batches = [make_sequences(rng, 32 + heavy_tailed_lengths(rng, args.batch, args.median, args.sigma,
                                                           args.cap, minimum=1), mc.vocab_size, prompt_len=32)
             for _ in range(args.repeats + 1)]
  learner.train(batches[0], version=learner.version)  # compile
  _prox_pass(learner, batches[0], args.token_budget)
  times, prox_times, policy_tokens, all_tokens = [], [], [], []
  for b in batches[1:]:
    t = time.perf_counter()
    learner.train(b, version=learner.version)  # reads metrics back at the end, so the update has finished
    times.append(time.perf_counter() - t)
    prox_times.append(_prox_pass(learner, b, args.token_budget))
    policy_tokens.append(sum(float(s.mask.sum()) for s in b))
    all_tokens.append(sum(len(s.tokens) for s in b))
  i = int(np.argsort(times)[len(times) // 2])
  sec, prox_sec = times[i], float(np.median(prox_times))
  flops = (6 + 2 * (args.minibatches - 1) / args.minibatches) * n_params * all_tokens[i] / sec
  result = dict(machine=machine(), config=vars(args) | {"params": n_params},
                policy_tokens_per_s=policy_tokens[i] / sec, tokens_per_s=all_tokens[i] / sec,
                update_seconds=sec, prox_pass_seconds=prox_sec, model_flops_per_s=flops, times=times,
                prox_times=prox_times)
  rows = [["model", f"{args.model} ({n_params / 1e6:.1f}M params, {args.dtype})"],
          ["policy tokens / s", result["policy_tokens_per_s"]], ["all tokens / s", result["tokens_per_s"]],
          ["seconds per update", sec], ["model TFLOP/s (update FLOPs, see below)", flops / 1e12],
          ["separate prox pass, seconds (saved)", prox_sec],
          ["update if the prox pass always ran, vs this", f"{(sec + prox_sec) / sec:.2f}x slower"]]
  notes = (f"One policy update of {args.batch} sequences (decoupled PPO, {args.minibatches} minibatch(es): "
           f"loss + AdamW) on one device, packed under a {args.token_budget}-token budget. The first "
           "minibatch's prox log-probs come from its own forward pass; the separate prox pass (one "
           "forward over the same micro-batches), which that avoids, is timed beside it.")
  write_result(args.name, result, ["measure", "value"], rows, notes,
               **({"out_dir": args.out} if args.out else {}))
  print(json.dumps({k: result[k] for k in ("policy_tokens_per_s", "tokens_per_s", "update_seconds",
                                           "model_flops_per_s")}))
  return 0


def _prox_pass(learner: Learner, sequences, token_budget: int) -> float:
  """Seconds of one forward over the update's packed micro-batches (what a separate prox pass costs)."""
  mbs = [jax.device_put(b) for b in batching.pack_sequences(list(sequences), token_budget)]
  t = time.perf_counter()
  out = [compute_logprobs(learner.model_config, learner.params, b.tokens, b.positions, b.segment_ids)
         for b in mbs]
  jax.block_until_ready(out)
  return time.perf_counter() - t


if __name__ == "__main__":
  sys.exit(main())

"""Each role's rate measured alone, for the planner: decode step time per slot count, learner tokens/s.

  .venv/bin/python benchmarks/role_rates.py --config=configs/default.py --slots=64 --slots=32 \
      --config.model.hf_path=WARM_START --config.rollout.length_workload=lognormal:median=32,sigma=1.15,cap=640 \
      --config.data.max_completion_len=640 --config.model.max_seq_len=704

Run on one device (the caller pins it to one core). Nothing else runs meanwhile, so the planner's
inputs never come from the arm it predicts:

* decode: the run's engine with every one of ``S`` slots busy (prompts of the task's typical length,
  completions long enough never to finish), seconds per fused decode step, for each ``--slots`` S; and
  the re-prefill a weight update costs, in decode steps (every slot re-prefilled at an in-flight length:
  its prompt plus a uniform share of a drawn completion length);
* learner: ``Learner.train`` on global batches of ``learner.batch_size`` sequences whose completion
  lengths come from the run's length workload (``rollout.length_workload``, or ``--workload`` when the
  config has none),
  policy tokens per second (median of ``--repeats`` updates after one that compiles).

Prints one JSON object (last line).
"""

from __future__ import annotations

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
from absl import flags  # noqa: E402

from asyncrl_jax import models  # noqa: E402

from asyncrl_jax.data.workloads import LengthWorkload  # noqa: E402
from asyncrl_jax.infra import sharding
from asyncrl_jax.learner.learner import Learner  # noqa: E402
from asyncrl_jax.rl import batching  # noqa: E402
from asyncrl_jax.rollout.engine import engine_from_config  # noqa: E402

PROMPT_LEN = 20  # tokens: about the built-in task's prompts


def decode_rate(config, model_config, params, mesh, slots: int, workload: LengthWorkload,
                steps: int = 48) -> dict:
  """Seconds per decode step with all ``slots`` busy, and one full re-prefill's cost in steps."""
  config = config.copy_and_resolve_references()
  config.rollout.num_slots = slots
  engine = engine_from_config(config, mesh, model_config, params=params)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, model_config.vocab_size, PROMPT_LEN)) for _ in range(slots)]
  room = engine.max_target_length - PROMPT_LEN
  state = engine.prefill_insert(params, engine.init_decode_state(), prompts, list(range(slots)),
                                [room] * slots, [room] * slots)
  chunk = min(16, steps)
  state, *_ = engine.steps(params, state, chunk)  # compiles
  jax.block_until_ready(state)
  engine.wait_for_compiles()  # (nothing compiles in the background while it is timed)
  t, done = time.perf_counter(), 0
  while done < steps:
    state, _, _, n = engine.steps(params, state, chunk)
    done += int(n)
  step_seconds = (time.perf_counter() - t) / done
  # in flight at an update: each slot part-way through a completion of a drawn length
  in_flight = PROMPT_LEN + np.minimum(
      (rng.uniform(size=slots) * workload.sample(slots, seed=1)).astype(int), room - 1)
  tokens = np.asarray(rng.integers(3, model_config.vocab_size, (slots, int(in_flight.max()))), np.int32)
  state = engine.refill(params, state, tokens, in_flight)  # compiles its shapes
  jax.block_until_ready(state)
  engine.wait_for_compiles()
  t = time.perf_counter()
  state = engine.refill(params, state, tokens, in_flight)
  jax.block_until_ready(state)
  refill_seconds = time.perf_counter() - t
  return dict(slots=slots, step_seconds=step_seconds, decode_tok_s=slots / step_seconds,
              refill_seconds=refill_seconds, refill_steps=refill_seconds / step_seconds)


def learner_rate(config, model_config, params, mesh, workload: LengthWorkload, repeats: int) -> dict:
  """Policy tokens per second of ``Learner.train`` on batches of the workload's lengths."""
  learner = Learner(model_config, params, mesh, config, versions=repeats + 1)
  rng = np.random.default_rng(0)
  batch = config.learner.batch_size

  def sequences(seed):
    out = []
    for n in workload.sample(batch, seed=seed):
      prompt = rng.integers(3, model_config.vocab_size, PROMPT_LEN)
      completion = rng.integers(3, model_config.vocab_size, int(n))
      out.append(batching.make_sequence(prompt, completion, logprobs=np.log(rng.uniform(0.2, 0.9, n)),
                                        versions=np.zeros(n, np.int32), advantage=float(rng.normal()),
                                        min_new_tokens=int(n) if config.rollout.length_workload else 0))
    return out

  learner.train(sequences(100), version=learner.version)  # compiles
  times, tokens = [], []
  for k in range(repeats):
    seqs = sequences(200 + k)
    t = time.perf_counter()
    learner.train(seqs, version=learner.version)
    times.append(time.perf_counter() - t)
    tokens.append(sum(float(s.mask.sum()) for s in seqs))
  i = int(np.argsort(times)[len(times) // 2])
  return dict(train_tok_s=tokens[i] / times[i], update_seconds=times[i], policy_tokens=tokens[i])


def main(argv) -> int:
  flags.DEFINE_multi_integer("slots", [], "slot counts to time the decode step at (default: the config's)")
  flags.DEFINE_integer("repeats", 3, "timed learner updates (after one that compiles)")
  flags.DEFINE_string("workload", "", "length workload when the config has none, e.g. "
                      "lognormal:median=18,sigma=0.8,cap=96")
  config_flag = cli.define_config_flag()
  cli.parse_flags(argv)
  config = cli.validated(config_flag.value)
  workload = LengthWorkload.parse(config.rollout.length_workload or flags.FLAGS.workload)
  if workload is None:
    raise SystemExit("give rollout.length_workload in the config, or --workload")
  mesh = sharding.make_mesh(jax.devices()[:1], dict(data=1, fsdp=1, tensor=1))
  model_config, params = models.from_config(config, mesh)
  decode = [decode_rate(config, model_config, params, mesh, s, workload)
            for s in (flags.FLAGS.slots or [config.rollout.num_slots])]
  learner = learner_rate(config, model_config, params, mesh, workload, flags.FLAGS.repeats)
  print(json.dumps(dict(decode=decode, learner=learner, workload=workload.spec,
                        devices=f"1 {jax.devices()[0].platform} device")))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))

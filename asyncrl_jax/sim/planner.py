"""Planner: choose the rollout:learner device split and the staleness bound eta.

AReaL splits devices 3:1 by hand. Given

* a trace-length distribution (lognormal parameters, or lengths logged by a run: fitted under the cap or
  resampled),
* measured decode throughput per device (tokens/s with ``slots_per_device`` sequences in flight) and
  training throughput per device (trained tokens/s),
* a device budget and the global batch size,

the planner simulates every split ``r`` rollout / ``D - r`` learner devices and every eta with the
straggler simulator (``asyncrl_jax.sim.straggler``) and predicts the effective throughput (trained
tokens/s) of each; the synchronous colocated baseline (all devices decode, then all train) is predicted
beside them. The model assumes devices are independent (true on accelerators; not for virtual CPU
devices sharing cores) and that per-device decode throughput does not depend on which devices decode.

``python -m asyncrl_jax.sim.planner --devices 8 --decode-tok-s 4000 --train-tok-s 20000 --json``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional, Sequence

from asyncrl_jax.sim import straggler
from asyncrl_jax.sim.lengths import LengthModel, fit_lognormal


@dataclasses.dataclass(frozen=True)
class Throughputs:
  """Measured per-device rates."""
  decode_tok_s: float  # generated tokens/s of one device with ``slots_per_device`` slots busy
  train_tok_s: float  # trained tokens/s of one learner device
  slots_per_device: int

  def __post_init__(self):
    for name in ("decode_tok_s", "train_tok_s"):
      if not getattr(self, name) > 0:
        raise ValueError(f"{name}={getattr(self, name)} must be > 0 (a measured rate)")
    if self.slots_per_device < 1:
      raise ValueError(f"slots_per_device={self.slots_per_device} must be >= 1")

  @property
  def step_seconds(self) -> float:
    """Seconds per decode step (each slot emits one token per step)."""
    return self.slots_per_device / self.decode_tok_s


@dataclasses.dataclass
class Candidate:
  rollout_devices: int
  learner_devices: int
  eta: int  # -1 marks the synchronous colocated baseline
  tokens_per_s: float
  slot_utilization: float
  learner_idle_fraction: float
  max_staleness: int


def predict(model: LengthModel, rates: Throughputs, *, rollout_devices: int, learner_devices: int,
            eta: int, batch: int, epochs: int = 100, seed: int = 0,
            interrupt_cost: float = 0.0) -> Candidate:
  """Predicted throughput of one split and eta (asynchronous, separate meshes)."""
  step = rates.step_seconds
  r = straggler.simulate_async(model, epochs=epochs, batch=batch,
                               slots=rollout_devices * rates.slots_per_device, eta=eta, seed=seed,
                               train_rate=rates.train_tok_s * learner_devices * step,
                               interrupt_cost=interrupt_cost)
  return Candidate(rollout_devices, learner_devices, eta, r.tokens_per_step / step, r.slot_utilization,
                   r.learner_idle_fraction, r.max_staleness)


def predict_colocated_sync(model: LengthModel, rates: Throughputs, *, devices: int, batch: int,
                           epochs: int = 100, seed: int = 0) -> Candidate:
  """Synchronous RL on all devices: decode a batch (LPT packing), then train it on the same devices."""
  step = rates.step_seconds
  train_rate = rates.train_tok_s * devices * step
  r = straggler.simulate_sync(model, epochs=epochs, batch=batch, slots=devices * rates.slots_per_device,
                              seed=seed, train_rate=train_rate)
  train_steps = r.tokens_per_step * r.steps / train_rate  # the devices train while nothing decodes
  return Candidate(devices, devices, -1, r.tokens_per_step / step, r.slot_utilization,
                   1.0 - train_steps / r.steps, 0)


def plan(model: LengthModel, rates: Throughputs, *, devices: int, batch: int,
         etas: Sequence[int] = (0, 1, 2, 4, 8), epochs: int = 100, seed: int = 0,
         interrupt_cost: float = 0.0) -> list[Candidate]:
  """Every split and eta, best first; the colocated synchronous baseline is included (eta -1)."""
  if devices < 2:
    raise ValueError(f"devices={devices}: a split needs at least 2 devices")
  if batch < 1:
    raise ValueError(f"batch={batch} must be >= 1")
  out = [predict_colocated_sync(model, rates, devices=devices, batch=batch, epochs=epochs, seed=seed)]
  for r in range(1, devices):
    for eta in etas:
      out.append(predict(model, rates, rollout_devices=r, learner_devices=devices - r, eta=eta,
                         batch=batch, epochs=epochs, seed=seed, interrupt_cost=interrupt_cost))
  return sorted(out, key=lambda c: -c.tokens_per_s)


def lengths_from_log(path: str) -> list[int]:
  """Completion lengths from a run's ``trained_prompts.jsonl`` (or a JSONL of ``{"length": n}``)."""
  lengths = []
  with open(path) as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      rec = json.loads(line)
      try:
        if "completion_lengths" in rec:
          lengths.extend(int(n) for n in rec["completion_lengths"])
        elif "length" in rec:
          lengths.append(int(rec["length"]))
        else:
          raise ValueError(f"{path}:{line_no}: no 'completion_lengths' or 'length' field")
      except TypeError as e:
        raise ValueError(f"{path}:{line_no}: lengths must be integers ({e})") from e
  lengths = [n for n in lengths if n > 0]
  if not lengths:
    raise ValueError(f"{path}: no positive lengths found")
  return lengths


def main(argv: Optional[list] = None) -> int:
  p = argparse.ArgumentParser(prog="python -m asyncrl_jax.sim.planner", description=__doc__.split("\n")[0])
  p.add_argument("--devices", type=int, required=True, help="device budget")
  p.add_argument("--decode-tok-s", type=float, required=True, help="measured decode tokens/s per device")
  p.add_argument("--train-tok-s", type=float, required=True, help="measured trained tokens/s per device")
  p.add_argument("--slots-per-device", type=int, default=32, help="slots behind --decode-tok-s")
  p.add_argument("--batch", type=int, default=512, help="trajectories per policy update")
  p.add_argument("--eta", type=int, nargs="*", default=[0, 1, 2, 4, 8])
  p.add_argument("--mu", type=float, default=7.4)
  p.add_argument("--sigma", type=float, default=1.15)
  p.add_argument("--cap", type=int, default=32768,
                 help="length cap; with --lengths-from give the run's data.max_completion_len")
  p.add_argument("--lengths-from", default="", help="trained_prompts.jsonl of a run (overrides mu/sigma)")
  p.add_argument("--fit", choices=("lognormal", "resample"), default="resample",
                 help="with --lengths-from: fit a censored lognormal or resample the logged lengths")
  p.add_argument("--epochs", type=int, default=100, help="simulated policy versions per candidate")
  p.add_argument("--interrupt-cost", type=float, default=0.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--top", type=int, default=10, help="candidates to print")
  p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
  args = p.parse_args(argv)
  if args.top < 1:
    p.error(f"--top={args.top} must be >= 1")
  try:
    if args.lengths_from:
      lengths = lengths_from_log(args.lengths_from)
      model = (fit_lognormal(lengths, args.cap) if args.fit == "lognormal" else
               LengthModel(samples=tuple(lengths), cap=args.cap))
    else:
      model = LengthModel(mu=args.mu, sigma=args.sigma, cap=args.cap)
    rates = Throughputs(args.decode_tok_s, args.train_tok_s, args.slots_per_device)
    cands = plan(model, rates, devices=args.devices, batch=args.batch, etas=args.eta,
                 epochs=args.epochs, seed=args.seed, interrupt_cost=args.interrupt_cost)
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  sync = next(c for c in cands if c.eta == -1)
  print(f"{args.devices} devices, batch {args.batch}, lengths: {model.describe()}")
  print(f"{'split (rollout:learner)':>24}  {'eta':>4}  {'tokens/s':>10}  {'vs sync':>7}  "
        f"{'slot util':>9}  {'learner idle':>12}")
  for c in cands[:args.top] + ([sync] if sync not in cands[:args.top] else []):
    split = "colocated sync" if c.eta == -1 else f"{c.rollout_devices}:{c.learner_devices}"
    print(f"{split:>24}  {c.eta if c.eta >= 0 else '-':>4}  {c.tokens_per_s:10.0f}  "
          f"{c.tokens_per_s / sync.tokens_per_s:6.2f}x  {c.slot_utilization:9.1%}  {c.learner_idle_fraction:12.1%}")
  if args.json:
    best = cands[0]
    print(json.dumps(dict(best=dataclasses.asdict(best), colocated_sync=dataclasses.asdict(sync),
                          candidates=[dataclasses.asdict(c) for c in cands], lengths=model.describe())))
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Straggler simulator: synchronous batches versus continuous asynchronous generation.

Time is measured in decode steps: a slot produces one token per step, so a trace of ``L`` tokens holds
its slot for ``L`` steps.

* **Synchronous** (the seed's experiment): each epoch draws ``batch`` lengths, packs them onto ``slots``
  by longest-processing-time first (which needs the lengths in advance, so it flatters the baseline),
  and lasts as long as the fullest slot; then the learner trains on the batch while every slot idles.
  Slot utilization is ``sum(lengths) / (slots * longest_slot)``; the headroom from decoupling is its
  inverse.
* **Asynchronous**: every slot takes the next trajectory as soon as it finishes one, subject to the
  AReaL admission bound ``floor(n / batch) <= version + eta`` for the ``n``-th trajectory (0-based); the
  learner trains batch after batch while generation continues. Batches are either blocks in admission
  order (what ``asyncrl_jax.controller.controller`` does: the count bound is then a hard staleness bound) or the
  oldest ``batch`` finished trajectories (AReaL's buffer; staleness of a straggler is then unbounded).
  An interrupt (weight update) may cost every in-flight slot ``interrupt_cost`` steps of re-prefill.

The learner's time per batch is ``batch_tokens / train_rate`` steps (``train_rate`` = trained tokens
per decode step; ``inf`` = free, as in the seed).

**Slots parked on an environment** (multi-turn episodes): ``park(rng, n)`` draws, per trajectory, the
steps its slot is held without decoding (its environment's time, e.g. tool calls, in decode steps).
A trajectory then holds its slot ``length + park`` steps and produces ``length`` tokens; in the
synchronous baseline it still finishes only when its slot has run it, so a batch waits for its
slowest episode, tool time included. ``group_size`` (synchronous) reports the group wait: per group of
``group_size`` consecutive trajectories, the mean over its members of the group's last finish minus
their own.

Run ``python -m asyncrl_jax.sim.straggler --json`` for the seed's configuration; its last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import sys
from typing import Optional

import numpy as np

from asyncrl_jax.sim.lengths import LengthModel

ORDERS = ("admission", "completion")


@dataclasses.dataclass
class SyncResult:
  slot_utilization: float  # generated tokens / (slots * decode steps), over all epochs
  headroom: float  # 1 / slot_utilization
  median_len: float
  mean_len: float
  mean_longest: float  # mean over epochs of the longest trace
  p_cap: float  # fraction of epochs with at least one trace at the cap
  tokens_per_step: float  # trained tokens per step including the learner's time
  steps: float  # total simulated steps
  group_wait: float = 0.0  # mean steps a finished member waits for its group's last (group_size)
  decode_steps_per_epoch: float = 0.0  # the mean makespan: steps a batch takes to generate


@dataclasses.dataclass
class AsyncResult:
  eta: int
  order: str
  slot_utilization: float  # useful decode tokens / (slots * steps) until the last trained version
  tokens_per_step: float  # trained tokens per step
  learner_idle_fraction: float
  max_staleness: int  # oldest data trained, in versions (admission version to trained version)
  mean_staleness: float
  steps: float


def lpt_makespan(lengths: np.ndarray, slots: int) -> int:
  """Longest-processing-time-first packing onto ``slots``; returns the fullest slot's load."""
  heap = [0] * min(slots, len(lengths))
  for n in np.sort(lengths)[::-1]:
    heapq.heapreplace(heap, heap[0] + int(n))
  return max(heap)


def lpt_finish(durations: np.ndarray, slots: int) -> np.ndarray:
  """Each job's finish time under longest-processing-time-first packing onto ``slots``."""
  heap = [(0.0, s) for s in range(min(slots, len(durations)))]
  finish = np.zeros(len(durations), np.float64)
  for j in np.argsort(-np.asarray(durations, np.float64), kind="stable"):
    load, s = heapq.heappop(heap)
    finish[j] = load + float(durations[j])
    heapq.heappush(heap, (finish[j], s))
  return finish


def group_wait(finish: np.ndarray, group_size: int) -> float:
  """Per group of ``group_size`` consecutive finish times, the mean of (the group's last - each);
  averaged over groups (0 without groups)."""
  if group_size < 2:
    return 0.0
  t = np.asarray(finish, np.float64).reshape(-1, group_size)
  return float((t.max(axis=1, keepdims=True) - t).mean())


def _park(park, rng: np.random.Generator, n: int) -> np.ndarray:
  if park is None:
    return np.zeros(n, np.float64)
  out = np.asarray(park(rng, n), np.float64)
  if out.shape != (n,) or not np.all(np.isfinite(out)) or out.min(initial=0) < 0:
    raise ValueError(f"park(rng, {n}) must give {n} finite step counts >= 0")
  return out


def simulate_sync(model: LengthModel, *, epochs: int, batch: int, slots: int, seed: int = 0,
                  train_rate: float = math.inf, park=None, group_size: int = 0) -> SyncResult:
  """The synchronous baseline: LPT-packed epochs, each as long as its fullest slot (a trajectory
  holds its slot for its length plus its ``park`` steps), then training."""
  _check_sizes(epochs=epochs, batch=batch, slots=slots)
  _check_train_rate(train_rate)
  if group_size > 1 and batch % group_size:
    raise ValueError(f"batch={batch} is not a multiple of group_size={group_size}")
  rng = np.random.default_rng(seed)
  lens = model.draw(rng, epochs * batch).reshape(epochs, batch)
  hold = lens + _park(park, rng, epochs * batch).reshape(epochs, batch)
  finishes = [lpt_finish(row, slots) for row in hold]
  makespans = np.array([f.max() for f in finishes], np.float64)
  waits = [group_wait(f, group_size) for f in finishes]
  tokens = lens.sum(axis=1).astype(np.float64)
  util = float(tokens.sum() / (slots * makespans.sum()))
  train_steps = tokens / train_rate if math.isfinite(train_rate) else np.zeros_like(tokens)
  steps = float(makespans.sum() + train_steps.sum())
  return SyncResult(slot_utilization=util, headroom=1.0 / util, median_len=float(np.median(lens)),
                    mean_len=float(lens.mean()), mean_longest=float(lens.max(axis=1).mean()),
                    p_cap=float(np.mean(lens.max(axis=1) >= model.cap)),
                    tokens_per_step=float(tokens.sum() / steps), steps=steps,
                    group_wait=float(np.mean(waits)), decode_steps_per_epoch=float(makespans.mean()))


def simulate_async(model: LengthModel, *, epochs: int, batch: int, slots: int, eta: int, seed: int = 0,
                   train_rate: float = math.inf, order: str = "admission",
                   interrupt_cost: float = 0.0, park=None) -> AsyncResult:
  """Continuous generation under the staleness bound until ``epochs`` batches have been trained (a
  trajectory holds its slot for its length plus its ``park`` steps)."""
  _check_sizes(epochs=epochs, batch=batch, slots=slots)
  if eta < 0:
    raise ValueError(f"eta={eta} must be >= 0")
  if order not in ORDERS:
    raise ValueError(f"order={order!r} must be one of {ORDERS}")
  _check_train_rate(train_rate)
  if not 0 <= interrupt_cost < math.inf:
    raise ValueError(f"interrupt_cost={interrupt_cost} must be a finite number >= 0")
  rng = np.random.default_rng(seed)
  # Enough trajectories for the trained batches plus everything the bound lets run ahead.
  lens = model.draw(rng, (epochs + eta + 1) * batch)
  sim = _AsyncSim(lens, epochs=epochs, batch=batch, slots=slots, eta=eta, train_rate=train_rate,
                  order=order, interrupt_cost=interrupt_cost, park=_park(park, rng, lens.size))
  sim.run()
  return sim.result()


class _AsyncSim:
  """One asynchronous run as a discrete-event simulation over decode steps.

  The event heap holds ``(time, kind, slot, generation)``: kind 0 = the trace on ``slot`` finished,
  kind 1 = the learner finished a batch (slot -1). A slot's generation moves whenever its finish time
  does (an interrupt), which invalidates the entries pushed before.
  """

  def __init__(self, lens: np.ndarray, *, epochs: int, batch: int, slots: int, eta: int,
               train_rate: float, order: str, interrupt_cost: float, park: Optional[np.ndarray] = None):
    self.lens, self.epochs, self.batch, self.slots, self.eta = lens, epochs, batch, slots, eta
    self.hold = lens + (park if park is not None else 0.0)  # steps each trajectory holds its slot
    self.train_rate, self.order, self.interrupt_cost = train_rate, order, interrupt_cost
    # per trajectory
    self.start = np.full(lens.size, np.nan)
    self.redone = np.zeros(lens.size)  # re-prefill steps each trace spent after interrupts
    self.admit_version = np.zeros(lens.size, np.int64)
    self.done = np.zeros(lens.size, bool)
    # per slot
    self.finish = np.full(slots, math.inf)
    self.running = np.full(slots, -1)
    self.gen = np.zeros(slots, np.int64)
    self.events: list = []
    self.pool: list = []  # completion order: finished trajectory indices (heap: oldest first)
    self.version, self.next_traj, self.t = 0, 0, 0.0
    self.learner_busy, self.learner_busy_steps, self.trained_tokens = False, 0.0, 0.0
    self.staleness: list = []  # per trained trajectory: trained version - admission version
    self.stale_of_batch: list = []  # the same for the batch in training

  def run(self) -> None:
    """Processes events until ``epochs`` versions have been trained; ``self.t`` is then the end."""
    self._admit(0.0)
    while self.version < self.epochs:
      self.t, kind, s, g = heapq.heappop(self.events)
      if kind == 0:
        self._trace_done(s, g)
      else:
        self._training_done()

  def _admit(self, now: float) -> None:
    """Fills free slots with the next trajectories the staleness bound lets start."""
    for s in np.flatnonzero(self.running < 0):
      n = self.next_traj
      if n // self.batch > self.version + self.eta or n >= self.lens.size:
        return
      self.running[s], self.start[n], self.admit_version[n] = n, now, self.version
      self.finish[s] = now + self.hold[n]
      heapq.heappush(self.events, (self.finish[s], 0, int(s), int(self.gen[s])))
      self.next_traj += 1

  def _next_batch(self) -> Optional[np.ndarray]:
    """The next batch's trajectory indices if it is complete, else None (pops them from the pool)."""
    if self.order == "admission":
      members = np.arange(self.version * self.batch, (self.version + 1) * self.batch)
      return members if self.done[members].all() else None
    if len(self.pool) < self.batch:
      return None
    return np.array([heapq.heappop(self.pool) for _ in range(self.batch)])

  def _try_train(self, now: float) -> None:
    """Starts training the next batch if the learner is free and the batch is complete."""
    if self.learner_busy:
      return
    members = self._next_batch()
    if members is None:
      return
    tokens = float(self.lens[members].sum())
    dur = tokens / self.train_rate if math.isfinite(self.train_rate) else 0.0
    self.learner_busy, self.learner_busy_steps = True, self.learner_busy_steps + dur
    self.trained_tokens += tokens
    self.stale_of_batch = list(self.version - self.admit_version[members])
    heapq.heappush(self.events, (now + dur, 1, -1, 0))

  def _trace_done(self, s: int, g: int) -> None:
    if g != self.gen[s]:
      return  # superseded by an interrupt
    n = self.running[s]
    self.done[n], self.running[s], self.finish[s] = True, -1, math.inf
    if self.order == "completion":
      heapq.heappush(self.pool, int(n))
    self._try_train(self.t)
    self._admit(self.t)

  def _training_done(self) -> None:
    self.learner_busy = False
    self.version += 1
    self.staleness.extend(self.stale_of_batch)
    if self.interrupt_cost:
      self._interrupt()
    if self.version < self.epochs:
      self._try_train(self.t)
    self._admit(self.t)

  def _interrupt(self) -> None:
    """New weights: every in-flight trace loses ``interrupt_cost`` steps to re-prefill."""
    for s in np.flatnonzero(self.running >= 0):
      self.finish[s] += self.interrupt_cost
      self.redone[self.running[s]] += self.interrupt_cost
      self.gen[s] += 1
      heapq.heappush(self.events, (self.finish[s], 0, int(s), int(self.gen[s])))

  def result(self) -> AsyncResult:
    # Useful decode work inside [0, t]: every admitted trace's tokens, cut at t.
    t, started = self.t, ~np.isnan(self.start)
    # a trajectory still running has produced its tokens in proportion to the time it held its slot
    held = np.maximum(t - self.start[started] - self.redone[started], 0.0)
    share = np.minimum(held / np.maximum(self.hold[started], 1e-12), 1.0)
    useful = (self.lens[started] * share).sum()
    return AsyncResult(eta=self.eta, order=self.order, slot_utilization=float(useful / (self.slots * t)),
                       tokens_per_step=self.trained_tokens / t,
                       learner_idle_fraction=1.0 - self.learner_busy_steps / t,
                       max_staleness=int(max(self.staleness)),
                       mean_staleness=float(np.mean(self.staleness)), steps=t)


def _check_train_rate(train_rate: float) -> None:
  if not train_rate > 0:
    raise ValueError(f"train_rate={train_rate} must be > 0 (trained tokens per decode step; inf = free)")


def _check_sizes(**sizes) -> None:
  for name, v in sizes.items():
    if int(v) != v or v < 1:
      raise ValueError(f"{name}={v} must be an integer >= 1")


def main(argv: Optional[list] = None) -> int:
  p = argparse.ArgumentParser(prog="python -m asyncrl_jax.sim.straggler", description=__doc__.split("\n")[0])
  p.add_argument("--epochs", type=int, default=400, help="batches (policy versions) to simulate")
  p.add_argument("--batch", type=int, default=512, help="trajectories per batch")
  p.add_argument("--slots", type=int, default=128, help="decode slots")
  p.add_argument("--mu", type=float, default=7.4, help="lognormal mu of trace length")
  p.add_argument("--sigma", type=float, default=1.15, help="lognormal sigma of trace length")
  p.add_argument("--cap", type=int, default=32768, help="length cap (tokens)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--eta", type=int, nargs="*", default=[0, 1, 2, 4, 8, 16],
                 help="staleness bounds for the asynchronous runs")
  p.add_argument("--order", choices=ORDERS, default="admission", help="asynchronous batch order")
  p.add_argument("--train-rate", type=float, default=math.inf,
                 help="trained tokens per decode step (default: training is free, as in the seed)")
  p.add_argument("--interrupt-cost", type=float, default=0.0,
                 help="decode steps each in-flight trace loses per weight update")
  p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
  args = p.parse_args(argv)
  try:
    model = LengthModel(mu=args.mu, sigma=args.sigma, cap=args.cap)
    sync = simulate_sync(model, epochs=args.epochs, batch=args.batch, slots=args.slots, seed=args.seed,
                         train_rate=args.train_rate)
    runs = [simulate_async(model, epochs=args.epochs, batch=args.batch, slots=args.slots, eta=e,
                           seed=args.seed, train_rate=args.train_rate, order=args.order,
                           interrupt_cost=args.interrupt_cost) for e in args.eta]
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"{args.epochs} epochs x {args.batch} rollouts on {args.slots} slots, {model.describe()}")
  print(f"median trace length      : {sync.median_len:8.0f} tok")
  print(f"mean longest-in-batch    : {sync.mean_longest:8.0f} tok  ({sync.mean_longest / sync.median_len:.1f}x "
        "the median)")
  print(f"P(batch has a capped trace) = {sync.p_cap:.0%}")
  print(f"synchronous slot utilization: {sync.slot_utilization:.1%}  (idle {1 - sync.slot_utilization:.1%})")
  print(f"headroom from decoupling : {sync.headroom:8.2f}x")
  print(f"asynchronous, batches in {args.order} order:")
  print(f"  {'eta':>4}  {'utilization':>11}  {'speedup':>7}  {'learner idle':>12}  max/mean staleness")
  for r in runs:
    print(f"  {r.eta:>4d}  {r.slot_utilization:11.1%}  {r.tokens_per_step / sync.tokens_per_step:6.2f}x  "
          f"{r.learner_idle_fraction:12.1%}  {r.max_staleness:>4d} / {r.mean_staleness:.2f}")
  if args.json:
    config = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()}
    out = dict(dataclasses.asdict(sync), config=config,
               asynchronous=[dataclasses.asdict(r) for r in runs])
    pick = next((r for r in runs if r.eta == 2), runs[-1] if runs else None)
    if pick is not None:
      out.update(async_slot_utilization=pick.slot_utilization, async_eta=pick.eta,
                 async_speedup=pick.tokens_per_step / sync.tokens_per_step)
    print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Straggler simulator: hand-computed schedules, invariants, the seed's numbers, the CLI."""

import json
import math

import numpy as np
import pytest

from asyncrl_jax.sim import straggler
from asyncrl_jax.sim.lengths import LengthModel, fit_lognormal


def test_lpt_makespan_hand_computed():
  # LPT on 2 slots: 5 | 4, then 3 -> 4+3, 3 -> 5+3, 3 -> 7+3: makespan 10 (the optimum is 9).
  assert straggler.lpt_makespan(np.array([3, 5, 3, 4, 3]), 2) == 10
  assert straggler.lpt_makespan(np.array([7]), 4) == 7


def test_sync_constant_lengths():
  # 10 traces of 6 tokens on 4 slots: 3 rounds -> 18 steps, 60 tokens of 72 slot-steps.
  r = straggler.simulate_sync(LengthModel(samples=(6,), cap=100), epochs=3, batch=10, slots=4)
  assert r.slot_utilization == pytest.approx(60 / 72)
  assert r.headroom == pytest.approx(72 / 60)
  assert r.steps == 54 and r.p_cap == 0.0 and r.mean_longest == 6
  # Training at 10 tokens per step adds 6 steps per epoch.
  r = straggler.simulate_sync(LengthModel(samples=(6,), cap=100), epochs=3, batch=10, slots=4,
                              train_rate=10.0)
  assert r.steps == 3 * (18 + 6)
  assert r.tokens_per_step == pytest.approx(180 / 72)


def test_async_constant_lengths_is_fully_busy():
  m = LengthModel(samples=(5,), cap=100)
  r = straggler.simulate_async(m, epochs=4, batch=8, slots=8, eta=0)
  # eta 0: each batch is exactly one round of 5 steps; training is free.
  assert r.steps == 20 and r.slot_utilization == 1.0 and r.max_staleness == 0
  assert r.tokens_per_step == pytest.approx(8.0)


def test_async_eta0_waits_for_training():
  # batch 4 on 4 slots, 5 steps of decode, then 20 tokens / 2 per step = 10 steps of training
  # during which eta 0 admits nothing: 15 steps per version.
  m = LengthModel(samples=(5,), cap=100)
  r = straggler.simulate_async(m, epochs=3, batch=4, slots=4, eta=0, train_rate=2.0)
  assert r.steps == 45
  assert r.learner_idle_fraction == pytest.approx(1 / 3)
  # eta 1: decode of batch k+1 overlaps training of batch k; the learner becomes the bottleneck.
  r1 = straggler.simulate_async(m, epochs=3, batch=4, slots=4, eta=1, train_rate=2.0)
  assert r1.steps == 5 + 3 * 10


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_admission_order_bounds_staleness(eta):
  m = LengthModel(mu=3.0, sigma=1.2, cap=400)
  r = straggler.simulate_async(m, epochs=40, batch=16, slots=8, eta=eta, seed=3, train_rate=20.0)
  assert r.max_staleness <= eta
  assert 0 < r.slot_utilization <= 1


def test_completion_order_lets_stragglers_exceed_the_count_bound():
  m = LengthModel(mu=3.0, sigma=1.5, cap=2000)
  r = straggler.simulate_async(m, epochs=60, batch=16, slots=16, eta=1, seed=0, order="completion")
  assert r.max_staleness > 1


def test_async_beats_sync_on_heavy_tails():
  m = LengthModel(mu=5.0, sigma=1.15, cap=2048)
  sync = straggler.simulate_sync(m, epochs=60, batch=64, slots=16, seed=1)
  asyn = straggler.simulate_async(m, epochs=60, batch=64, slots=16, eta=4, seed=1)
  assert asyn.slot_utilization > 0.9 > sync.slot_utilization
  assert asyn.tokens_per_step > 1.5 * sync.tokens_per_step


def test_seed_experiment_statistics():
  # The seed: 400 epochs x 512 on 128 slots gives 38.1% and 2.62x; 100 epochs agree within noise.
  r = straggler.simulate_sync(LengthModel(), epochs=100, batch=512, slots=128, seed=0)
  assert r.slot_utilization == pytest.approx(0.381, abs=0.006)
  assert r.headroom == pytest.approx(2.62, abs=0.05)
  assert r.median_len == pytest.approx(1636, rel=0.03)  # exp(7.4) = 1636
  assert r.p_cap > 0.8


def test_fit_lognormal_recovers_parameters_under_censoring():
  rng = np.random.default_rng(0)
  true = LengthModel(mu=6.0, sigma=1.0, cap=2000)
  x = true.draw(rng, 20000)
  assert np.mean(x >= true.cap) > 0.05  # the cap censors a real share
  fit = fit_lognormal(x, true.cap)
  # floor() shifts lengths down by < 1 token: a small bias in mu at this scale
  assert fit.mu == pytest.approx(6.0, abs=0.03) and fit.sigma == pytest.approx(1.0, abs=0.03)
  with pytest.raises(ValueError, match="below the cap"):
    fit_lognormal([2000, 2000, 5], 2000)
  with pytest.raises(ValueError, match=r"\[1, cap"):
    fit_lognormal([0, 4, 5], 2000)


def test_interrupts_cost_time_not_tokens():
  # 4 slots, batch 4, 10-token traces, eta 1, training 40 tokens per step (1 step per batch):
  # every version interrupts the next batch's traces, each interrupt costs 3 steps.
  m = LengthModel(samples=(10,), cap=100)
  free = straggler.simulate_async(m, epochs=5, batch=4, slots=4, eta=1, train_rate=40.0)
  slow = straggler.simulate_async(m, epochs=5, batch=4, slots=4, eta=1, train_rate=40.0, interrupt_cost=3)
  assert slow.steps > free.steps
  # the same tokens were decoded in more time: utilization drops by the ratio of the times
  assert slow.tokens_per_step == pytest.approx(free.tokens_per_step * free.steps / slow.steps)
  assert slow.slot_utilization <= free.slot_utilization * free.steps / slow.steps + 1e-9


def test_bad_sizes_are_named():
  with pytest.raises(ValueError, match="slots=0"):
    straggler.simulate_sync(LengthModel(), epochs=1, batch=4, slots=0)
  with pytest.raises(ValueError, match="eta=-1"):
    straggler.simulate_async(LengthModel(), epochs=1, batch=4, slots=2, eta=-1)
  with pytest.raises(ValueError, match="sigma"):
    LengthModel(sigma=0.0)


def test_cli_json_last_line(capsys):
  rc = straggler.main(["--epochs", "20", "--batch", "64", "--slots", "16", "--mu", "5", "--cap", "4096",
                       "--eta", "0", "2", "--json"])
  assert rc == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  for key in ("slot_utilization", "headroom", "median_len", "mean_longest", "p_cap",
              "async_slot_utilization"):
    assert key in out and math.isfinite(out[key])
  assert out["config"]["train_rate"] is None  # "free" training, written as JSON null, not Infinity
  assert 0 < out["slot_utilization"] < out["async_slot_utilization"] <= 1
  assert straggler.main(["--slots", "0"]) == 2
  assert straggler.main(["--train-rate", "0"]) == 2
  assert straggler.main(["--interrupt-cost", "-1", "--epochs", "2"]) == 2


def test_lpt_finish_times_and_the_group_wait_by_hand():
  # 5 -> slot 0 (5), 4 -> slot 1 (4), 3 -> slot 1 (7), 3 -> slot 0 (8), 3 -> slot 1 (10)
  assert straggler.lpt_finish(np.array([3, 5, 3, 4, 3]), 2).tolist() == [7, 5, 8, 4, 10]
  assert straggler.group_wait(np.array([7, 5, 8, 4, 10, 10]), 3) == pytest.approx(((1 + 3 + 0) + (6 + 0 + 0)) / 6)
  assert straggler.group_wait(np.array([7, 5]), 1) == 0.0


def test_parked_slots_hold_their_slot_without_decoding():
  """Every trajectory decodes 6 tokens and waits 4 steps on its environment. Synchronous, 10 per
  batch on 4 slots: three rounds of 10 steps (LPT), so 60 tokens in 120 slot-steps; groups of 5
  finish at [10, 10, 10, 10, 20] and [20, 20, 20, 30, 30]: waits 8 and 6. Asynchronous: a slot
  decodes 6 of every 10 steps."""
  model = LengthModel(samples=(6,), cap=100)
  park = lambda rng, n: np.full(n, 4.0)  # noqa: E731
  r = straggler.simulate_sync(model, epochs=3, batch=10, slots=4, park=park, group_size=5)
  assert r.slot_utilization == pytest.approx(60 / 120) and r.decode_steps_per_epoch == 30
  assert r.group_wait == pytest.approx(7.0)
  without = straggler.simulate_sync(model, epochs=3, batch=10, slots=4, group_size=5)
  assert without.slot_utilization == pytest.approx(60 / 72) and without.decode_steps_per_epoch == 18
  a = straggler.simulate_async(model, epochs=200, batch=10, slots=4, eta=2, park=park)
  assert a.slot_utilization == pytest.approx(0.6, abs=0.02)
  assert straggler.simulate_async(model, epochs=200, batch=10, slots=4, eta=2).slot_utilization \
      == pytest.approx(1.0, abs=0.02)
  with pytest.raises(ValueError, match="finite step counts"):
    straggler.simulate_sync(model, epochs=1, batch=4, slots=2, park=lambda rng, n: -np.ones(n))

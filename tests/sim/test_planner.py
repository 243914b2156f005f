"""Planner: hand-computed predictions with constant lengths, the choice it makes, its inputs and CLI."""

import json

import pytest

from asyncrl_jax.sim import planner
from asyncrl_jax.sim.lengths import LengthModel


def test_constant_lengths_hand_computed():
  # 10-token traces, 4 slots per device decoding at 40 tok/s (one step = 0.1 s).
  rates = planner.Throughputs(decode_tok_s=40.0, train_tok_s=100.0, slots_per_device=4)
  m = LengthModel(samples=(10,), cap=100)
  # 1 rollout device, batch 4: decode 1 s per batch (40 tokens); learner (3 devices, 300 tok/s) 0.133 s.
  # eta >= 1 overlaps them: decode bound, 40 tok/s.
  c = planner.predict(m, rates, rollout_devices=1, learner_devices=3, eta=1, batch=4, epochs=20)
  assert c.tokens_per_s == pytest.approx(40.0, rel=0.03)
  # eta 0: decode 1 s + train 40/300 s per batch.
  c0 = planner.predict(m, rates, rollout_devices=1, learner_devices=3, eta=0, batch=4, epochs=20)
  assert c0.tokens_per_s == pytest.approx(40 / (1 + 40 / 300), rel=1e-6)
  # Colocated sync on 4 devices: 16 slots, batch 4 decodes in 1 s on 4 busy slots, trains 40/400 s.
  s = planner.predict_colocated_sync(m, rates, devices=4, batch=4, epochs=20)
  assert s.tokens_per_s == pytest.approx(40 / (1 + 0.1), rel=1e-6)
  assert s.slot_utilization == pytest.approx(0.25)


def test_learner_bound_split_is_predicted():
  # Training is slow (10 tok/s per device): with 3 rollout devices the single learner is the bottleneck.
  rates = planner.Throughputs(decode_tok_s=40.0, train_tok_s=10.0, slots_per_device=4)
  m = LengthModel(samples=(10,), cap=100)
  c = planner.predict(m, rates, rollout_devices=3, learner_devices=1, eta=4, batch=4, epochs=40)
  assert c.tokens_per_s == pytest.approx(10.0, rel=0.03)
  assert c.learner_idle_fraction < 0.05


def test_plan_prefers_decoupling_on_heavy_tails():
  rates = planner.Throughputs(decode_tok_s=4000.0, train_tok_s=20000.0, slots_per_device=16)
  m = LengthModel(mu=5.0, sigma=1.2, cap=4096)
  cands = planner.plan(m, rates, devices=4, batch=64, etas=(0, 2, 4), epochs=30)
  assert len(cands) == 1 + 3 * 3
  assert [c.tokens_per_s for c in cands] == sorted((c.tokens_per_s for c in cands), reverse=True)
  best = cands[0]
  sync = next(c for c in cands if c.eta == -1)
  assert best.eta > 0 and best.tokens_per_s > 1.3 * sync.tokens_per_s
  assert all(c.max_staleness <= max(c.eta, 0) for c in cands)


def test_bad_inputs_are_named(tmp_path):
  with pytest.raises(ValueError, match="decode_tok_s"):
    planner.Throughputs(decode_tok_s=0, train_tok_s=1, slots_per_device=1)
  rates = planner.Throughputs(1.0, 1.0, 1)
  with pytest.raises(ValueError, match="devices=1"):
    planner.plan(LengthModel(), rates, devices=1, batch=4)
  bad = tmp_path / "log.jsonl"
  bad.write_text('{"version": 0}\n')
  with pytest.raises(ValueError, match="completion_lengths"):
    planner.lengths_from_log(str(bad))


def test_cli_from_logged_lengths(tmp_path, capsys):
  log = tmp_path / "trained_prompts.jsonl"
  log.write_text("\n".join(json.dumps({"version": v, "prompts": [v], "completion_lengths": [5, 9, 40, 7]})
                           for v in range(5)) + "\n")
  rc = planner.main(["--devices", "3", "--decode-tok-s", "100", "--train-tok-s", "400",
                     "--slots-per-device", "4", "--batch", "8", "--eta", "0", "2", "--cap", "64",
                     "--epochs", "10", "--lengths-from", str(log), "--json"])
  assert rc == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert len(out["candidates"]) == 1 + 2 * 2
  assert {(c["rollout_devices"], c["learner_devices"], c["eta"]) for c in out["candidates"]} == {
      (3, 3, -1), (1, 2, 0), (1, 2, 2), (2, 1, 0), (2, 1, 2)}
  assert all(c["max_staleness"] <= max(c["eta"], 0) for c in out["candidates"])
  assert "20 logged lengths" in out["lengths"]
  assert planner.main(["--devices", "1", "--decode-tok-s", "1", "--train-tok-s", "1"]) == 2

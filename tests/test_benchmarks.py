"""Benchmark arithmetic that turns logged metrics into the reported figures."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.async_vs_sync import window_metrics


def _rec(t, tokens, decoded, slot_steps, idle, learner_s, stale=1, interrupt=0.0, transfer=0.1, servers=1):
  return dict(time=t, trained_tokens=tokens, decode_tokens=decoded, decode_slot_steps=slot_steps,
              decode_idle_seconds=idle, learner_seconds=learner_s, max_staleness_seen=stale,
              mean_staleness=stale, decode_interrupt_seconds=interrupt, transfer_seconds=transfer,
              decode_servers=servers)


def test_window_metrics_hand_computed():
  records = [_rec(10.0, 999, 900, 1000, 5.0, 3.0),  # skipped (compilation)
             _rec(12.0, 100, 1000, 1200, 5.5, 1.0, interrupt=0.2),  # start of the window
             _rec(14.0, 200, 1300, 1600, 6.0, 0.5, interrupt=0.5),
             _rec(16.0, 300, 1500, 2000, 6.5, 0.5, stale=2, interrupt=0.8, transfer=0.3)]
  m = window_metrics(records, skip=1)
  assert m["transfer_seconds_per_version"] == pytest.approx(0.2)  # (0.1 + 0.3) / 2
  assert m["seconds"] == 4.0 and m["trained_tokens"] == 500
  assert m["tokens_per_s"] == pytest.approx(125.0)
  # 500 tokens decoded over 800 slot-steps, decode server idle 1 s of 4
  assert m["slot_occupancy"] == pytest.approx(500 / 800)
  assert m["slot_utilization"] == pytest.approx(500 / 800 * 0.75)
  assert m["learner_idle_fraction"] == pytest.approx(1 - 1.0 / 4)
  assert m["learner_tokens_per_s"] == pytest.approx(500.0)
  assert m["max_staleness_seen"] == 2
  # re-prefill: 0.6 s over the window's 2 versions, of 3 s of decoding
  assert m["interrupt_seconds_per_version"] == pytest.approx(0.3)
  assert m["interrupt_share_of_decode"] == pytest.approx(0.6 / 3.0)
  with pytest.raises(ValueError, match="more than 3"):
    window_metrics(records[:3], skip=2)
  # two decode servers: idle seconds are summed over both, so each waited 0.5 s of the 4
  two = [dict(r, decode_servers=2) for r in records]
  assert window_metrics(two, skip=1)["slot_utilization"] == pytest.approx(500 / 800 * (1 - 0.5 / 4))


def test_lognormal_workload_predictions_and_report(tmp_path, capsys):
  """The workload mode's planner inputs come from the rates measured alone, the learner-bound flag
  follows them, and the report carries the quick JSON line the issue asks for."""
  import argparse  # pylint: disable=import-outside-toplevel
  from benchmarks import async_vs_sync as avs  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.data.workloads import LengthWorkload  # pylint: disable=import-outside-toplevel
  args = argparse.Namespace(warm_start_steps=10, override=[], out=str(tmp_path))
  w = LengthWorkload(median=32, sigma=1.15, cap=640)
  flags = avs.workload_flags(w, 64)
  assert flags[0] == "--config.rollout.length_workload=lognormal:median=32,sigma=1.15,cap=640"
  assert "--config.model.max_seq_len=704" in flags  # 48 + 640, rounded up to 64

  def rates(train):
    return {"decode": {64: dict(decode_tok_s=5000.0, refill_steps=3.0, step_seconds=64 / 5000),
                       32: dict(decode_tok_s=8000.0, refill_steps=6.0, step_seconds=0.004)},
            "learner": dict(train_tok_s=train)}

  slow = avs.workload_predictions(rates(1900.0), w, slots=64, batch=256, cores=2, etas=[0, 2])
  fast = avs.workload_predictions(rates(1e6), w, slots=64, batch=256, cores=2, etas=[0, 2])
  assert slow["learner_bound"] and not fast["learner_bound"]
  assert 2.2 < slow["headroom"] < 3.0  # the seed's shape (4 trajectories per slot): about 2.6x
  # a learner-bound split cannot beat its learner's rate; a free one approaches decode x utilization
  assert slow["arms"]["2"]["tokens_per_s"] <= 1900.0 * 1.01
  assert fast["arms"]["2"]["tokens_per_s"] > fast["arms"]["0"]["tokens_per_s"] * 1.5
  arms = {}
  for label, tok, util in [(avs.COLOCATED, 2000.0, 0.4), ("0", 1500.0, 0.35), ("2", 1800.0, 0.9),
                           ("2 drain", 1200.0, 0.5)]:
    arms[label] = dict(tokens_per_s=tok, decode_tokens_per_s=2 * tok, slot_utilization=util,
                       learner_idle_fraction=0.1, max_staleness_seen=2, mean_staleness=1.0,
                       interrupt_seconds_per_version=0.1, drain_seconds_per_version=0.0,
                       eta=int(label.split()[0]) if label != avs.COLOCATED else 0,
                       predicted=slow["arms"].get(label))
  run = dict(steps=10, skip=3, etas=[0, 2], slots=64, batch=256, cores=[0, 1], t0=0.0)
  name = "async_vs_sync_lognormal"
  assert avs._write_workload(args, name, arms, slow, rates(1900.0), w, run) == 0  # pylint: disable=protected-access
  last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert set(last) == {"sync_tokens_per_s", "async_tokens_per_s", "ratio", "predicted_ratio",
                       "predicted_headroom", "slot_utilization", "workload"}
  assert last["ratio"] == pytest.approx(0.9) and last["slot_utilization"] == 0.9
  assert last["predicted_ratio"] == pytest.approx(slow["arms"]["2"]["tokens_per_s"]
                                                  / slow["arms"][avs.COLOCATED]["tokens_per_s"])
  result = json.loads((tmp_path / f"{name}.json").read_text())
  assert result["interrupt_gain_vs_drain"] == pytest.approx(0.5)
  md = (tmp_path / f"{name}.md").read_text()
  assert "learner is the bottleneck" in md and "| 2 drain | 1,200 |" in md
  assert (tmp_path / f"{name}.png").stat().st_size > 1000
  # the summary puts each figure beside the seed's / AReaL's
  from benchmarks import throughput_summary  # pylint: disable=import-outside-toplevel
  assert throughput_summary.main(["--results", str(tmp_path)]) == 0
  summary = (tmp_path / "throughput_summary.md").read_text()
  assert "| async eta 2 / colocated sync, trained tok/s | 0.90x | 2.77x" in summary
  assert "| interruptible vs drain-then-switch at eta 2, trained tok/s | +50.0% | +12-17%" in summary
  assert "packing_lognormal not run" in summary


def test_straggler_benchmark_writes_its_result(tmp_path, capsys):
  from benchmarks import straggler as bench
  assert bench.main(["--seeds", "2", "--epochs", "4", "--out", str(tmp_path)]) == 0
  last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert 0 < last["slot_utilization"] < last["async_slot_utilization_eta2"] <= 1
  result = json.loads((tmp_path / "straggler.json").read_text())
  assert len(result["sync"]) == 2 and set(result["asynchronous"]) == {"0", "1", "2", "4", "8", "16"}
  md = (tmp_path / "straggler.md").read_text()
  # our computed figure and the seed's sit in the same row
  row = next(line for line in md.splitlines() if line.startswith("| synchronous slot utilization"))
  assert f"{result['slot_utilization']:.1%}" in row and row.rstrip(" |").endswith("38.1%")
  assert (tmp_path / "straggler.png").stat().st_size > 1000


def test_moe_layer_quick_checks_grouped_against_dense_and_times_both(tmp_path, capfd, monkeypatch):
  """The quick run (one cell): both paths' forward and forward + backward timed, their values checked
  against each other, the nominal FLOP ratio E / k; a grouped path that pairs the routing weights with
  the wrong experts stops the run, naming the cell (negative control). No wall-clock time asserted."""
  from asyncrl_jax.models import moe  # pylint: disable=import-outside-toplevel
  from benchmarks import moe_layer  # pylint: disable=import-outside-toplevel
  assert moe_layer.main(["--quick", "--out", str(tmp_path)]) == 0
  last = json.loads(capfd.readouterr().out.strip().splitlines()[-1])  # (capfd: the module arms faulthandler)
  assert set(last) == {"64,16,4"}
  result = json.loads((tmp_path / "moe_layer.json").read_text())
  assert result["config"]["cells"] == [[64, 16, 4]] and result["config"]["repeats"] == 2
  assert {"cpu", "cpu_count", "jax", "commit"} <= set(result["machine"])
  for cell in result["cells"]:
    assert cell["nominal_flop_ratio"] == cell["experts"] / cell["top_k"]
    assert set(cell["check"]) == {"y", "grad_x", "grad_logits", "grad_gate", "grad_up", "grad_down"}
    assert cell["max_rel_diff"] <= 1e-4 and cell["check"]["y"]["ref_max_abs"] > 0.1  # (not all zeros)
    for kind in ("fwd", "fwd+bwd"):
      assert set(cell[kind]["us_per_token"]) == {"dense", "grouped"}
      assert [len(cell[kind]["runs_seconds"][p]) for p in ("dense", "grouped")] == [2, 2]
  md = (tmp_path / "moe_layer.md").read_text()
  assert "| N | E | k | fwd us/token dense |" in md and "| 64 | 16 | 4 |" in md and "cpu_count=" in md

  def swapped(x_nd, experts_nk, weights_nk, *kernels):
    return moe.experts_grouped(x_nd, experts_nk, weights_nk[:, ::-1], *kernels)

  monkeypatch.setitem(moe_layer.PATHS, "grouped", swapped)
  with pytest.raises(AssertionError, match="N=16 E=4 k=2: grouped and dense y differ"):
    moe_layer.main(["--cells", "16,4,2", "--repeats", "1", "--out", str(tmp_path / "broken")])


@pytest.mark.slow(23)
def test_gpu_script_runs_end_to_end_at_a_tiny_size(tmp_path):
  """The accelerator script (never run in CI on an accelerator) still works: same steps, tiny sizes."""
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), MODEL="demo", ASYNC="0",
             DTYPE="float32", SLOTS="4", NEW_TOKENS="8", BATCH="8", BUDGET="1024", MEDIAN="8", CAP="32")
  out = subprocess.run(["bash", "benchmarks/gpu/run.sh", str(tmp_path)], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  engine = json.loads((tmp_path / "gpu_engine_demo.json").read_text())
  learner = json.loads((tmp_path / "gpu_learner_demo.json").read_text())
  assert engine["engine_tok_s"] > 0 and learner["policy_tokens_per_s"] > 0
  planner = (tmp_path / "gpu_planner_demo.md").read_text()
  assert "a prediction, not a measurement" in planner and "colocated sync" in planner


def test_twin_figures_hand_computed():
  from benchmarks.twin import figures  # pylint: disable=import-outside-toplevel
  rec = lambda t, tok, blocked, pull: dict(time=t, trained_tokens=tok, learner_seconds=0.5,
                                           publish_blocked_seconds=blocked, transfer_seconds=pull)
  run = {"metrics": [rec(20.0, 999, 9.0, 9.0),  # compilation: excluded
                     rec(22.0, 100, 0.01, 0.02), rec(25.0, 300, 0.03, 0.04)],
         "summary": dict(max_staleness_seen=1, learner_processes=2, decode_servers=2,
                         transfer_bytes_sent=[10, 12]), "seconds": 40.0}
  f = figures(run, skip=1)
  assert f["tokens_per_s"] == pytest.approx(400 / 5.0)  # versions 2-3: 400 tokens in 25 - 20 s
  assert f["seconds_per_version"] == pytest.approx(2.5)
  assert f["publish_blocked_seconds"] == pytest.approx(0.02)
  assert f["transfer_seconds"] == pytest.approx(0.03)
  assert f["transfer_bytes_sent"] == [10, 12] and f["wall_seconds"] == 40.0


def test_soak_fault_effects_and_lineage_hand_computed(tmp_path):
  from benchmarks.soak import fault_effects, lineage  # pylint: disable=import-outside-toplevel
  # 1 version/s for 60 s, a learner restart at t=60 back to version 50 (lost work), then 2 s per
  # version: it passes 60 + 3 = 63 again at t = 60 + 2 * 13 = 86
  progress = [(t, t) for t in range(61)] + [(60 + t, 50 + t // 2) for t in range(1, 61)]
  got = fault_effects(progress, 60.0)
  assert got["recovery_s"] == 26
  assert got["dip"] == pytest.approx((65 - 60) / 30 / 1.0)  # by t=90 it is 5 past the high of 60
  assert fault_effects(progress, 60.0, after=40.0)["dip"] == pytest.approx((70 - 60) / 40 / 1.0)
  assert fault_effects([(t, t) for t in range(30)], 10.0, versions_past=100)["recovery_s"] is None
  rows = [{"version": 0, "prompts": [1, 0], "trajectory_ids": ["a", "b"]},
          {"version": 1, "prompts": [2, 2], "trajectory_ids": ["c", "c"]}]
  (tmp_path / "trained_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert lineage(str(tmp_path), per_batch=2) == {
      "versions": 2, "versions_in_order": True, "prompts_lost": 1, "prompts_trained_twice": 1,
      "trajectories_trained_twice": 1}


def test_ablation_selection_monitor_averages_and_plots(tmp_path):
  from benchmarks import staleness_ablation  # pylint: disable=import-outside-toplevel
  records = [{"version": 1, "masked_frac_len_1_16": 0.2, "masked_frac_stale_0": 0.1, "effective_batch": 0.9},
             {"version": 2, "masked_frac_len_1_16": 0.4, "masked_frac_len_17_32": 0.6,
              "masked_frac_stale_0": 0.3, "masked_frac_stale_3_4": 0.5, "effective_batch": 0.7},
             {"version": 3, "reward": 0.5}]  # (a version without the monitor counts for nothing)
  sel = staleness_ablation._selection(records)  # pylint: disable=protected-access
  assert sel == pytest.approx({"masked_frac_len_1_16": 0.3, "masked_frac_len_17_32": 0.6,
                               "masked_frac_stale_0": 0.2, "masked_frac_stale_3_4": 0.5,
                               "effective_batch": 0.8})
  png = tmp_path / "selection.png"
  staleness_ablation._plot_selection({"dis eta 8": sel, "old arm": {}}, str(png))  # pylint: disable=protected-access
  assert png.stat().st_size > 1000


def test_ablation_arm_record_reads_the_mechanism_and_plots(tmp_path):
  from benchmarks import staleness_ablation as ab  # pylint: disable=import-outside-toplevel
  arm = tmp_path / "ppo_eta16_seed0"
  arm.mkdir()
  records = [{"version": 1, "kl_behav": 0.02, "clipped_frac": 0.1, "dropped_frac": 0.0, "mean_staleness": 3.0},
             {"version": 2, "kl_behav": 0.04, "clipped_frac": 0.3, "dropped_frac": 0.0, "mean_staleness": 5.0,
              "eval_accuracy": 0.4}]
  (arm / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  summary = {"initial_eval_accuracy": 0.3, "initial_eval_greedy_accuracy": 0.6, "final_eval_accuracy": 0.4,
             "final_eval_greedy_accuracy": 0.5, "max_staleness_seen": 7, "rl_seconds_this_run": 12.0}
  rec = ab._arm_record(str(tmp_path), arm.name, summary, arm="ppo", eta=16, seed=0)  # pylint: disable=protected-access
  assert rec["kl_behav"] == pytest.approx(0.03) and rec["clipped_frac"] == pytest.approx(0.2)
  assert rec["mean_staleness"] == pytest.approx(4.0) and rec["max_staleness_seen"] == 7
  assert rec["evals"] == {2: 0.4} and rec["value_explained_variance"] is None
  assert rec["initial"] == 0.3 and rec["initial_greedy"] == 0.6
  assert ab._eta_flag(ab.UNBOUNDED, 80) == 80 and ab._eta_flag(4, 80) == 4  # pylint: disable=protected-access
  with pytest.raises(Exception, match="not an integer"):
    ab._parse_eta("-3")  # pylint: disable=protected-access
  png = tmp_path / "ablation.png"
  other = dict(rec, eta=ab.UNBOUNDED, final=0.35, kl_behav=0.1)
  ab._plot([rec, other], 0.3, [16, ab.UNBOUNDED], ["ppo"], str(png))  # pylint: disable=protected-access
  assert png.stat().st_size > 1000


def test_ablation_arm_records_are_reused_checked_and_assembled(tmp_path):
  """Finished arms are kept as records; a rerun reuses them, refuses a record of another grid or of
  another warm start, and ``--assemble-only`` writes the table with the missing cells named."""
  from benchmarks import staleness_ablation as ab  # pylint: disable=import-outside-toplevel
  grid = dict(steps=80, overrides=ab.GRID["overrides"])
  records = ab.ArmRecords(str(tmp_path / "staleness_ablation_arms"), grid)
  assert records.get("ppo_eta0_seed0") is None
  base = dict(arm="ppo", loss="ppo", eta=0, seed=0, initial=0.3, initial_greedy=0.6, final=0.41, final_greedy=0.5,
              evals={20: 0.35, 80: 0.41}, kl_behav=0.001, clipped_frac=0.002, dropped_frac=0.0,
              mean_staleness=0.0, max_staleness_seen=0, rl_seconds=100.0, value_explained_variance=None,
              selection={})
  kept = records.put("ppo_eta0_seed0", base)
  assert kept["grid"] == grid and kept["commit"]
  again = records.get("ppo_eta0_seed0")
  assert again["evals"] == {20: 0.35, 80: 0.41} and again["final"] == 0.41  # keys back to versions
  # the same seed samples the warm start's pass@1 the same way; any seed decodes it greedily the same
  with pytest.raises(SystemExit, match="warm start differs"):
    records.put("ppo_eta16_seed0", dict(base, eta=16, initial=0.31))
  with pytest.raises(SystemExit, match="initial_greedy"):
    records.put("ppo_eta0_seed1", dict(base, seed=1, initial_greedy=0.61))
  records.put("ppo_eta0_seed1", dict(base, seed=1, initial=0.33, final=0.45))  # another seed's sample
  records.put("ppo_eta16_seed0", dict(base, eta=16, final=0.37, evals={20: 0.33, 80: 0.37},
                                      max_staleness_seen=14, mean_staleness=7.5))
  with pytest.raises(SystemExit, match="use another --name"):
    ab.ArmRecords(records.path, dict(grid, steps=60)).get("ppo_eta0_seed0")
  assert ab.main(["--assemble-only", "--arms", "ppo", "--etas", "0", "16", "2", "--seeds", "2",
                  "--out", str(tmp_path)]) == 0
  md = (tmp_path / "staleness_ablation.md").read_text()
  assert "| 0 | 43.0 +- 2.8 |" in md and "| 16 | 37.0 |" in md and "| 2 | - |" in md
  assert "| warm start (before RL) | 31.5 +- 2.1 |" in md  # each seed's own sample of it
  assert "Not run yet (3 of 6 cells):** ppo_eta2_seed0" in md
  assert "negative: no fall): ppo 6.0 at eta 16." in md  # (41 + 45) / 2 - 37; eta 2 has no cell
  result = json.loads((tmp_path / "staleness_ablation.json").read_text())
  assert result["missing"] == ["ppo_eta2_seed0", "ppo_eta16_seed1", "ppo_eta2_seed1"]
  assert len(result["runs"]) == 3


def test_ablation_pairs_each_arm_with_naive_ppo_run_by_run(tmp_path):
  """The table states each arm against naive PPO at the same eta and seed, over the stale cells only."""
  from benchmarks import staleness_ablation as ab  # pylint: disable=import-outside-toplevel
  grid = dict(steps=80, overrides=ab.GRID["overrides"])
  records = ab.ArmRecords(str(tmp_path / "staleness_ablation_arms"), grid)
  base = dict(arm="ppo", loss="ppo", eta=0, seed=0, initial=0.3, initial_greedy=0.6, final=0.41, final_greedy=0.5,
              evals={80: 0.41}, kl_behav=0.001, clipped_frac=0.002, dropped_frac=0.0, mean_staleness=0.0,
              max_staleness_seen=0, rl_seconds=100.0, value_explained_variance=None, selection={})
  finals = {("ppo", 0, 0): 0.41, ("ppo", 0, 1): 0.45, ("ppo", 4, 0): 0.40, ("ppo", 4, 1): 0.44,
            ("decoupled_ppo", 0, 0): 0.50, ("decoupled_ppo", 4, 0): 0.37, ("decoupled_ppo", 4, 1): 0.45,
            ("dis", 4, 1): 0.30}  # dis has no eta-0 cell and no seed-0 run: one pair
  for (arm, eta, seed), final in finals.items():
    records.put(f"{arm}_eta{eta}_seed{seed}", dict(base, arm=arm, loss=arm, eta=eta, seed=seed, final=final,
                                                   initial=0.3 + 0.01 * seed))
  assert ab.main(["--assemble-only", "--arms", "ppo", "decoupled_ppo", "dis", "--etas", "0", "4", "--seeds",
                  "2", "--out", str(tmp_path)]) == 0
  md = (tmp_path / "staleness_ablation.md").read_text()
  # eta 4: 0.37 - 0.40 = -3, 0.45 - 0.44 = +1 -> mean -1.0, sd 2.8; the eta-0 pair (+9) is left out
  assert "mean +- sd: decoupled_ppo -1.0 +- 2.8 (n=2, above in 1); dis -14.0 (n=1, above in 0)." in md
  result = json.loads((tmp_path / "staleness_ablation.json").read_text())
  assert result["decoupled_ppo_minus_ppo_stale"] == pytest.approx([-0.03, 0.01])
  assert "ppo_minus_ppo_stale" not in result


def test_ablation_pinned_pairs_each_arm_with_its_own_eta0_seed_by_seed(tmp_path):
  """--staleness-mode=pinned: the run's name and overrides say so, and the table states each arm at
  eta minus its own eta-0 run with the same seed (hand-computed), with the new mechanism columns."""
  from benchmarks import staleness_ablation as ab  # pylint: disable=import-outside-toplevel
  grid = dict(steps=40, overrides=ab.GRID["overrides"] + ["--config.rl.staleness_mode=pinned"])
  records = ab.ArmRecords(str(tmp_path / "staleness_ablation_pinned_arms"), grid)
  base = dict(arm="ppo_recompute", loss="ppo_recompute", eta=0, seed=0, initial=0.3, initial_greedy=0.6,
              final=0.41, final_greedy=0.5, evals={40: 0.41}, kl_behav=0.001, clipped_frac=0.002,
              dropped_frac=0.0, mean_staleness=0.0, max_staleness_seen=0, rl_seconds=100.0,
              value_explained_variance=None, selection={}, ratio_p50=1.0, ratio_p90=1.2, ratio_p99=2.0,
              ratio_max=30.0, sides={"masked_frac_hi_neg": 0.01})
  finals = {(0, 0): 0.40, (0, 1): 0.44, (8, 0): 0.12, (8, 1): 0.20, (4, 1): 0.43}
  for (eta, seed), final in finals.items():
    records.put(f"ppo_recompute_eta{eta}_seed{seed}", dict(base, eta=eta, seed=seed, final=final,
                                                           initial=0.3 + 0.01 * seed))
  assert ab.main(["--staleness-mode=pinned", "--steps", "40", "--assemble-only", "--arms", "ppo_recompute",
                  "--etas", "0", "4", "8", "--seeds", "2", "--out", str(tmp_path)]) == 0
  md = (tmp_path / "staleness_ablation_pinned.md").read_text()
  # eta 8: 0.12 - 0.40 = -28, 0.20 - 0.44 = -24 -> -26.0 +- 2.8; eta 4: seed 1 only, 43 - 44 = -1
  assert "ppo_recompute: eta 4 -1.0 (n=1), eta 8 -26.0 +- 2.8 (n=2)" in md
  assert "| 1.00 / 1.20 / 2.00 (30) | - / 1.00% / - / - |" in md
  result = json.loads((tmp_path / "staleness_ablation_pinned.json").read_text())
  assert result["ppo_recompute_minus_eta0"]["8"] == pytest.approx([-0.28, -0.24])
  assert result["config"]["etas"] == [0, 4, 8] and result["config"]["seeds"] == [0, 1]
  with pytest.raises(SystemExit, match="pinned has no eta"):
    ab.main(["--staleness-mode=pinned", "--etas", "unbounded", "--assemble-only", "--out", str(tmp_path)])


def test_ablation_fits_accuracy_against_the_staleness_reached():
  """Final pass@1 on mean staleness reached, by least squares: checked against a hand-computed exact
  line and the textbook closed forms."""
  from benchmarks import staleness_ablation as ab  # pylint: disable=import-outside-toplevel
  run = lambda arm, s, f: dict(arm=arm, mean_staleness=s, final=f)
  exact = [run("ppo", 0.0, 0.44), run("ppo", 2.0, 0.43), run("ppo", 4.0, 0.42), run("dis", 1.0, 0.2)]
  fit = ab.staleness_fit(exact, "ppo")  # 0.44 - 0.005 s exactly: no residual
  assert fit["intercept"] == pytest.approx(0.44) and fit["slope"] == pytest.approx(-0.005)
  assert fit["slope_se"] == pytest.approx(0.0, abs=1e-9) and fit["n"] == 3 and fit["staleness"] == [0.0, 4.0]
  noisy = [run("dec", s, f) for s, f in [(0, .44), (1.9, .42), (3.3, .38), (4.3, .41), (7.1, .385)]]
  fit = ab.staleness_fit(noisy, "dec")
  x, y = np.array([0, 1.9, 3.3, 4.3, 7.1]), np.array([.44, .42, .38, .41, .385])
  slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()  # Sxy / Sxx
  intercept = y.mean() - slope * x.mean()
  assert fit["slope"] == pytest.approx(slope) and fit["intercept"] == pytest.approx(intercept)
  resid = y - (intercept + slope * x)  # the textbook standard error of a slope: s / sqrt(Sxx), s on n - 2
  assert fit["slope_se"] == pytest.approx(np.sqrt(resid @ resid / 3 / ((x - x.mean()) ** 2).sum()))
  assert ab.staleness_fit(exact, "dis") is None  # one run: no line
  assert ab.staleness_fit([run("a", 2.0, .4), run("a", 2.0, .5)], "a") is None  # no spread in staleness


def test_results_assembly_keeps_hand_written_sections(tmp_path, monkeypatch):
  from benchmarks import run_all  # pylint: disable=import-outside-toplevel
  results = tmp_path / "results"
  results.mkdir()
  (results / "transfer.md").write_text("# transfer\n\nmeasured table\n")
  (tmp_path / "RESULTS.md").write_text("# Benchmark results\n\n## transfer\n\nOLD-TEXT\n\n## soak\n\nthree runs, "
                                       "written by hand\n\n## gone\n\nnot a benchmark\n")
  monkeypatch.setattr(run_all, "HERE", str(tmp_path))
  monkeypatch.setattr(run_all, "RESULTS", str(results))
  text = open(run_all.assemble()).read()
  assert "measured table" in text and "OLD-TEXT" not in text  # a benchmark's section comes from its file
  assert text.count("## soak") == 1 and "three runs, written by hand" in text
  assert text.index("## soak") > text.index("## transfer")
  assert "## gone" not in text and "## straggler\n\n" in text  # (not run yet: says so)


def test_slow_tools_group_wait_is_the_seeds_and_predictions_follow_the_latency():
  from benchmarks import slow_tools  # pylint: disable=import-outside-toplevel
  assert slow_tools.group_wait([5, 8, 13, 40], 4) == pytest.approx(23.5)  # the seed's worked example
  assert slow_tools.group_wait([5, 8, 13, 40, 1, 1, 1, 1], 4) == pytest.approx(23.5 / 2)
  assert slow_tools.group_wait([5, 8], 1) == 0.0
  # the simulator, calibrated on a reference by hand: 128 episodes of 20 decode steps on 128 slots
  # take 20 steps, the learner 0.5 of the 1.0 s a version takes, so a decode step is 25 ms
  reference = dict(seconds_per_version=1.0, learner_idle_fraction=0.5, trained_tokens=128 * 20 * 10, versions=10)
  common = dict(lengths=[20] * 50, slots=128, batch=128, group_size=8, median=0.2, reference=reference,
                epochs=20)
  wide = slow_tools.predictions(calls_per_episode=1.0, sigma=1.15, **common)
  narrow = slow_tools.predictions(calls_per_episode=1.0, sigma=0.01, **common)
  none = slow_tools.predictions(calls_per_episode=0.0, sigma=1.15, **common)
  assert wide["step_seconds"] == pytest.approx(0.025)
  # no tool: the reference itself; a 0.2 s call (8 steps) parks every slot alike: 0.5 + 28 x 25 ms
  assert none["group_wait_seconds"] == 0.0 and none["sync_seconds_per_version"] == pytest.approx(1.0)
  assert narrow["group_wait_seconds"] < 0.01 and narrow["sync_seconds_per_version"] == pytest.approx(1.2, abs=0.01)
  # heavy-tailed calls: a batch waits for its slowest episode; groups wait; asynchrony hides part of it
  assert wide["group_wait_seconds"] > 0.3 and wide["sync_seconds_per_version"] > 2.5
  assert wide["async"]["eta 2"]["tokens_per_s"] > wide["sync_tokens_per_s"] * 1.3
  assert none["async"]["eta 2"]["slot_utilization"] > wide["async"]["eta 2"]["slot_utilization"]


def test_ablation_runs_fresh_seeds_and_reruns_a_record_of_other_training_code(tmp_path, monkeypatch):
  """--first-seed picks the seeds, --final-eval reaches every arm's config, a record whose training
  code commit differs is run again (one that matches is reused), and uncommitted training code runs
  nothing."""
  from benchmarks import staleness_ablation as ab  # pylint: disable=import-outside-toplevel
  ran = []
  summary = {"steps": 40}
  monkeypatch.setattr(ab, "_warm_start", lambda work, py, overrides: "ws")
  monkeypatch.setattr(ab, "_run_arm", lambda py, work, name, steps, args: ran.append((name, args)) or summary)
  base = dict(arm="decoupled_ppo", loss="decoupled_ppo", eta=0, initial=0.3, initial_greedy=0.6,
              final=0.41, final_greedy=0.5, evals={40: 0.41}, kl_behav=0.001, clipped_frac=0.002,
              dropped_frac=0.0, mean_staleness=0.0, max_staleness_seen=0, rl_seconds=100.0,
              value_explained_variance=None, selection={})
  monkeypatch.setattr(ab, "_arm_record", lambda work, name, s, **f: dict(base, **f))
  argv = ["--staleness-mode=pinned", "--steps", "40", "--arms", "decoupled_ppo", "--etas", "0",
          "--seeds", "2", "--first-seed", "100", "--final-eval", "500x16", "--out", str(tmp_path),
          "--workdir", str(tmp_path / "work"), "--name", "factor"]
  monkeypatch.setattr(ab, "code_commit", lambda: "abc1234")
  assert ab.main(argv) == 0
  assert [n for n, _ in ran] == ["decoupled_ppo_eta0_seed100", "decoupled_ppo_eta0_seed101"]
  args = ran[0][1]
  assert "--config.seed=100" in args and "--config.data.final_eval_problems=500" in args
  assert "--config.data.final_eval_samples=16" in args
  kept = json.loads((tmp_path / "factor_arms" / "decoupled_ppo_eta0_seed101.json").read_text())
  assert kept["code_commit"] == "abc1234" and kept["seed"] == 101
  # seed 100's record is of other code: run again; seed 101's matches: reused
  path = tmp_path / "factor_arms" / "decoupled_ppo_eta0_seed100.json"
  path.write_text(json.dumps(dict(json.loads(path.read_text()), code_commit="0ld0ld0")))
  ran.clear()
  assert ab.main(argv) == 0
  assert [n for n, _ in ran] == ["decoupled_ppo_eta0_seed100"]
  assert json.loads(path.read_text())["code_commit"] == "abc1234"
  monkeypatch.setattr(ab, "code_commit", lambda: "abc1234+changes")
  with pytest.raises(SystemExit, match="uncommitted changes"):
    ab.main(argv)
  with pytest.raises(SystemExit):
    ab.main(argv[:-4] + ["--final-eval", "500"])


def test_staleness_factors_gap_intervals_verdicts_and_shared_eta0_cell(tmp_path):
  """Each factor's gap is Welch's interval (scipy's own t-test gives the same), the stopping rule
  reads it against 1.5 points, and factor (e) takes the reference's eta-0 cell, its effect being the
  eta-8 difference alone."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  from benchmarks import staleness_factors as sf  # pylint: disable=import-outside-toplevel
  a, b = [40.0, 42.0, 44.0], [30.0, 34.0]
  gap = sf.welch(a, b)
  ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.98)
  assert gap["diff"] == pytest.approx(10.0) and (gap["low"], gap["high"]) == pytest.approx((ci.low, ci.high))
  assert gap["se"] == pytest.approx(np.sqrt(4 / 3 + 4))  # var 4 over 3 runs, var 8 over 2
  assert sf.verdict(dict(low=2.0, high=5.0)) == "does not close the gap"
  assert sf.verdict(dict(low=-1.0, high=1.0)) == "closes the gap"
  assert sf.verdict(dict(low=0.5, high=2.5)) == "consistent with the target"
  assert sf.verdict(dict(low=-2.0, high=4.0)) == "open"

  def put(factor, arm, eta, seed, final):
    d = tmp_path / f"staleness_factor_{factor}_arms"
    d.mkdir(exist_ok=True)
    (d / f"{arm}_eta{eta}_seed{seed}.json").write_text(json.dumps(dict(
        arm=arm, eta=eta, seed=seed, final=final, final_greedy=0.5, initial=0.3, initial_greedy=0.6,
        final_se=0.005, commit="abc", code_commit="abc")))
  for seed, (zero, eight) in enumerate([(0.40, 0.30), (0.42, 0.34), (0.44, 0.32)]):
    put("base", "decoupled_ppo", 0, seed, zero)
    put("base", "decoupled_ppo", 8, seed, eight)
    put("behav", "ppo", 8, seed, eight + 0.05)
    put("clip04", "decoupled_ppo", 0, seed, zero)
    put("clip04", "decoupled_ppo", 8, seed, zero - 0.04 + 0.01 * seed)
  put("behav", "decoupled_ppo", 8, 9, 0.99)  # another arm's record in the directory: not read
  assert sf.main(["--assemble-only", "--out", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "staleness_factors.json").read_text())
  base, behav = result["factors"]["base"], result["factors"]["behav"]
  assert base["gap"]["diff"] == pytest.approx(42.0 - 32.0) and base["seeds"] == {"0": [0, 1, 2], "8": [0, 1, 2]}
  assert behav["eta0"] == base["eta0"] and behav["eta0_from"] == "base"
  assert behav["gap"]["diff"] == pytest.approx(42.0 - 37.0)
  assert behav["effect"]["diff"] == pytest.approx(32.0 - 37.0)  # the eta-8 difference alone
  clip = result["factors"]["clip04"]  # gap 42 - 39 = 3 against the reference's 10
  assert clip["effect"]["diff"] == pytest.approx(3.0 - 10.0) and clip["effect"]["n"] == [3, 3, 3, 3]
  # variances 4 (36, 39, 42 at eta 8: 9), 4 and 4 of the reference, each over 3 runs
  assert clip["effect"]["se"] == pytest.approx(np.sqrt((4 + 9 + 4 + 4) / 3))
  assert "token_mean" in result["missing"] and base["eval_se"] == pytest.approx(0.5)
  md = (tmp_path / "staleness_factors.md").read_text()
  assert "| base | the pinned grid's regime (reference) | 40 | 3 / 3 | 42.0 +- 2.0 | 32.0 +- 2.0 |" in md
  # decision 0041: a factor on other training code has no effect against the reference, and a gap
  # whose cells ran different training code (behav's eta 8 against the reference's eta 0) none
  for seed in range(3):
    for eta in (0, 8):
      path = tmp_path / "staleness_factor_clip04_arms" / f"decoupled_ppo_eta{eta}_seed{seed}.json"
      path.write_text(json.dumps(dict(json.loads(path.read_text()), code_commit="def")))
    path = tmp_path / "staleness_factor_behav_arms" / f"ppo_eta8_seed{seed}.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), code_commit="def")))
  assert sf.main(["--assemble-only", "--out", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "staleness_factors.json").read_text())
  clip, behav = result["factors"]["clip04"], result["factors"]["behav"]
  assert clip["gap"]["diff"] == pytest.approx(3.0) and "refused" not in clip["gap"]  # one code: kept
  assert clip["effect"]["diff"] is None and "def against the reference's abc" in clip["effect"]["refused"]
  assert behav["verdict"].startswith("refused") and behav["code_commits"] == ["abc", "def"]
  md = (tmp_path / "staleness_factors.md").read_text()
  assert "refused (training code def against the reference's abc)" in md


def test_lora_int8_learning_gain_share_and_kl_per_version(tmp_path):
  """Each variant's gain over the warm start, its share of full-weight RL's gain and its KL per
  version, hand-computed from fake records; a variant without records is reported as not run."""
  from benchmarks import lora_int8_learning as li  # pylint: disable=import-outside-toplevel

  def put(variant, seed, final, kl, mismatch=None):
    d = tmp_path / f"lora_int8_learning_{variant}_arms"
    d.mkdir(exist_ok=True)
    rec = dict(arm="decoupled_ppo", eta=0, seed=seed, final=final, final_greedy=0.5, initial=0.30,
               initial_greedy=0.64, final_se=0.005, commit="abc", code_commit="abc", kl_behav=float(np.mean(kl)),
               rl_seconds=100.0, curves=dict(kl_behav=kl))
    if mismatch is not None:  # (lora8's records predate the metric)
      rec.update(kl_behav_prox=float(np.mean(mismatch)), curves=dict(kl_behav=kl, kl_behav_prox=mismatch))
    (d / f"decoupled_ppo_eta0_seed{seed}.json").write_text(json.dumps(rec))
  for seed, (full, lo) in enumerate([(0.40, 0.34), (0.42, 0.36), (0.44, 0.35)]):
    put("full", seed, full, [0.5, 0.5], [0.0, 0.0])
    put("lora8", seed, lo, [0.0, 0.0])
    put("int8", seed, full - 0.01, [0.5, 0.5], [0.01 * (seed + 1), 0.02 * (seed + 1)])
  assert li.main(["--assemble-only", "--out", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "lora_int8_learning.json").read_text())["variants"]
  assert result["full"]["gain"]["diff"] == pytest.approx(12.0)  # 42 - 30
  assert result["lora8"]["gain"]["diff"] == pytest.approx(5.0)  # 35 - 30
  assert result["lora8"]["share_of_full_gain"] == pytest.approx(5.0 / 12.0)
  assert result["int8"]["share_of_full_gain"] == pytest.approx(11.0 / 12.0)
  assert result["int8"]["kl_behav_prox_per_version"] == pytest.approx([0.02, 0.04])
  assert result["int8"]["kl_behav_prox_mean"] == pytest.approx(0.03)
  assert result["int8"]["kl_behav_per_version"] == pytest.approx([0.5, 0.5])
  assert result["lora8"]["kl_behav_prox_mean"] is None and result["lora8"]["kl_behav_prox_per_version"] == []
  assert result["lora8_lr10x"]["missing"]
  md = (tmp_path / "lora_int8_learning.md").read_text()
  assert "| lora8_lr10x |" in md and "not run yet" in md and "+5.0 [" in md
  assert "| 3.00e-02 | 5.00e-01 |" in md and "| 0.00e+00 | 5.00e-01 |" in md


def test_greedy_diagnosis_names_the_first_mistake_of_a_completion():
  """Hand-made completions of 3+4+5= (solution 3+4=7;7+5=12;#12), one per kind."""
  from benchmarks.greedy_diagnosis import classify  # pylint: disable=import-outside-toplevel
  p = dict(question="3+4+5=", answer="12", solution="3+4=7;7+5=12;#12")
  assert classify(p, "3+4=7;7+5=12;#12") == "correct"
  assert classify(p, "3+4=8;8+5=13;#13") == "addition error"
  assert classify(p, "3+4=7;7+4=11;#11") == "term error"  # a term misread
  assert classify(p, "3+5=8;8+5=13;#13") == "term error"  # a term skipped
  assert classify(p, "3+4=7;#7") == "chain length"
  assert classify(p, "3+4=7;7+5=12;#13") == "answer not the last sum"
  assert classify(p, "3+4=7;7+5=12") == "malformed"
  assert classify(p, "3+4=7;7+x=12;#1") == "malformed"


def test_code_ab_alternates_the_arms_and_reports_head_over_base(tmp_path, monkeypatch):
  """The two commits run in their own worktrees, base first in even rounds and head first in odd
  ones; the ratio is head / base of the medians (hand-computed from fake results)."""
  from benchmarks import code_ab
  calls = []
  fake = {"base": {"engine_tok_s": [100.0, 120.0, 110.0], "reference_tok_s": [200.0, 200.0, 200.0]},
          "head": {"engine_tok_s": [90.0, 99.0, 130.0], "reference_tok_s": [250.0, 150.0, 300.0]}}

  def run(tree, bench, out):
    side = os.path.basename(tree)
    i = sum(1 for s, b in calls if s == side)
    calls.append((side, bench))
    assert os.path.isfile(os.path.join(tree, "benchmarks", "run_all.py"))  # a real checkout of the commit
    return {m: fake[side][m][i] for m in ("engine_tok_s", "reference_tok_s")}

  monkeypatch.setattr(code_ab, "_run", run)
  assert code_ab.main(["--base", "HEAD", "--rounds", "3", "--benchmarks", "engine_throughput",
                       "--out", str(tmp_path)]) == 0
  assert [s for s, _ in calls] == ["base", "head", "head", "base", "base", "head"]
  result = json.load(open(tmp_path / "code_ab.json"))
  engine = result["metrics"]["engine_tok_s"]
  assert engine["base"] == 110.0 and engine["head"] == 99.0 and engine["ratio"] == pytest.approx(0.9)
  assert engine["round_ratios"] == pytest.approx([0.9, 99 / 120, 130 / 110])
  assert result["metrics"]["reference_tok_s"]["ratio"] == pytest.approx(1.25)
  assert "0.900" in (tmp_path / "code_ab.md").read_text()
  assert not [t for t in os.listdir(tmp_path) if t in ("base", "head")]


def test_staleness_headline_cells_gaps_and_claims_by_hand(tmp_path):
  """Fake records of 3 seeds: the recipe loses 1 point at eta 8 (holds against 1.5 only if the
  interval is narrow), the baseline 20; greedy rises 1 point over each arm's own start. The claims
  follow from hand-computed intervals, and a cell's eta-0 runs are shared with the baseline. The
  second recipe's records (arm decoupled_ppo in its own directory) are its cells, against the same
  baseline."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  from benchmarks import staleness_headline as sh  # pylint: disable=import-outside-toplevel
  d, dk = tmp_path / "staleness_headline_arms", tmp_path / "staleness_headline_kl_arms"
  d.mkdir()
  dk.mkdir()
  finals = {("decoupled_ppo", 0): [0.44, 0.45, 0.46], ("decoupled_ppo", 8): [0.43, 0.44, 0.45],
            ("decoupled_ppo", 4): [0.44, 0.44, 0.44], ("decoupled_ppo", 16): [0.42, 0.43, 0.44],
            ("ppo_recompute", 4): [0.40, 0.41, 0.42], ("ppo_recompute", 8): [0.23, 0.24, 0.25],
            ("ppo_recompute", 16): [0.10, 0.11, 0.12]}
  for (arm, eta), values in finals.items():
    for i, final in enumerate(values):
      seed = 100 + i
      record = dict(arm=arm, eta=eta, seed=seed, final=final, final_se=0.017, final_greedy=0.62 + 0.01 * i,
                    initial_final=0.30, initial_final_greedy=0.61 + 0.01 * i, kl_behav=0.001,
                    kl_behav_prox=0.0, code_commit="abc")
      (d / f"{arm}_eta{eta}_seed{seed}.json").write_text(json.dumps(record))
      # the KL recipe and its baseline: 2 points lower at every eta, greedy as their start
      (dk / f"{arm}_eta{eta}_seed{seed}.json").write_text(json.dumps(dict(
          record, final=final - 0.02, final_greedy=0.61 + 0.01 * i, code_commit="def")))
  assert sh.main(["--assemble-only", "--out", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "staleness_headline.json").read_text())
  assert result["cells"]["ppo_recompute_eta0"]["final"] == pytest.approx([44.0, 45.0, 46.0])
  assert result["cells"]["ppo_recompute_eta0"]["shared_with"] == "decoupled_ppo"
  claims = result["claims"]["decoupled_ppo"]
  gap = claims["recipe_gap_at_eta8"]["gap"]
  half = stats.t.ppf(0.975, 4.0) * np.sqrt(1.0 / 3 + 1.0 / 3)  # (both cells: sd 1, equal: df 4)
  assert gap["diff"] == pytest.approx(1.0) and gap["high"] == pytest.approx(1.0 + half)
  assert claims["recipe_gap_at_eta8"]["verdict"] == "open"  # (1 + 2.27 straddles 1.5)
  below = claims["baseline_below_at_eta8"]
  assert below["difference"]["diff"] == pytest.approx(20.0) and below["verdict"] == "holds"
  greedy = claims["greedy_not_below_start"]
  assert greedy["change"]["0"]["mean"] == pytest.approx(1.0) and greedy["change"]["0"]["low"] == pytest.approx(1.0)
  assert greedy["verdict"] == "holds"  # (+1 on every seed: a zero-width interval above 0)
  gain = claims["regime_gain_at_eta0"]
  assert gain["gain"]["mean"] == pytest.approx(15.0) and gain["verdict"] == "holds"
  # the KL recipe: its own cells (shifted by 2) against its own baseline (shifted by 2): the same gap
  # and the same lead; its baseline's eta 0 is its own
  kl = result["claims"]["decoupled_ppo_kl"]
  assert result["cells"]["decoupled_ppo_kl_eta8"]["final"] == pytest.approx([41.0, 42.0, 43.0])
  assert result["cells"]["ppo_recompute_kl_eta8"]["final"] == pytest.approx([21.0, 22.0, 23.0])
  assert result["cells"]["ppo_recompute_kl_eta0"]["final"] == pytest.approx([42.0, 43.0, 44.0])
  assert result["cells"]["ppo_recompute_kl_eta0"]["shared_with"] == "decoupled_ppo_kl"
  assert result["cells"]["decoupled_ppo_kl_eta8"]["code_commits"] == ["def"]
  assert kl["recipe_gap_at_eta8"]["gap"]["diff"] == pytest.approx(1.0)
  assert kl["baseline_below_at_eta8"]["difference"]["diff"] == pytest.approx(20.0)
  assert kl["greedy_not_below_start"]["change"]["8"]["mean"] == pytest.approx(0.0)
  assert kl["greedy_not_below_start"]["verdict"] == "holds"  # (mean 0 on every seed: not below the start)
  md = (tmp_path / "staleness_headline.md").read_text()
  assert "| ppo_recompute (= decoupled_ppo) | 0 | 3 | 45.0 +- 1.0 |" in md and "**recipe_gap_at_eta8**: open" in md
  assert "| decoupled_ppo_kl | 8 | 3 | 42.0 +- 1.0 |" in md and "| ppo_recompute_kl (= decoupled_ppo_kl) | 0 | 3 |" in md
  # a greedy fall fails the claim; the baseline within 10 points fails its
  for f in d.iterdir():
    r = json.loads(f.read_text())
    r.update(final_greedy=r["initial_final_greedy"] - 0.03)
    if r["arm"] == "ppo_recompute" and r["eta"] == 8:
      r.update(final=r["final"] + 0.15)
    f.write_text(json.dumps(r))
  result = sh.assemble(str(tmp_path))
  assert result["claims"]["decoupled_ppo"]["greedy_not_below_start"]["verdict"] == "fails"
  assert result["claims"]["decoupled_ppo"]["baseline_below_at_eta8"]["verdict"] == "fails"


def test_staleness_headline_plan_keeps_each_recipe_in_its_own_records_and_workdir():
  """The KL recipe's arms and its baseline's run with its override into their own records and work
  directory; decoupled PPO's and its baseline's without it; --no-baseline leaves the baseline out."""
  from benchmarks import staleness_headline as sh  # pylint: disable=import-outside-toplevel
  plan = sh.plan("/w", [100], "decoupled_ppo_kl")
  (what_r, recipe), (what_b, base) = plan
  assert what_r.startswith("seed 100: decoupled_ppo_kl") and what_b.startswith("seed 100: ppo_recompute")
  flag = lambda argv, name: argv[argv.index(name) + 1]
  assert flag(recipe, "--name") == "staleness_headline_kl" and flag(recipe, "--workdir") == "/w/staleness_headline_kl"
  assert f"--arm-override=--config.rl.kl_coef={sh.KL_COEF}" in recipe
  assert what_b.startswith("seed 100: ppo_recompute_kl")
  assert flag(base, "--name") == "staleness_headline_kl" and flag(base, "--workdir") == "/w/staleness_headline_kl"
  assert f"--arm-override=--config.rl.kl_coef={sh.KL_COEF}" in base and flag(base, "--arms") == "ppo_recompute"
  (_, plain), (_, plain_base) = sh.plan("/w", [100], "decoupled_ppo")
  assert flag(plain_base, "--workdir") == "/w" and not any(a.startswith("--arm-override") for a in plain + plain_base)
  assert base[base.index("--etas") + 1:base.index("--etas") + 4] == ["4", "8", "16"]
  assert len(sh.plan("/w", [100, 101], "decoupled_ppo", baseline=False)) == 2


def test_rl_vs_rft_tabulates_finished_arms_with_their_standard_errors(tmp_path):
  """Finished arms in --workdir are read, not rerun: the table holds each arm's mean pass@1 and SE
  (hand values), and arms evaluated differently are refused."""
  script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "rl_vs_rft.py")
  run = lambda: subprocess.run([sys.executable, script, "--steps", "5", "--seeds", "2", "--workdir", str(work),
                                "--out", str(out)], capture_output=True, text=True, timeout=300)
  work, out = tmp_path / "work", tmp_path / "out"
  (work / "ws").mkdir(parents=True)
  (work / "ws" / "sft_summary.json").write_text(json.dumps(dict(
      final_eval_accuracy=0.025, final_eval_greedy_accuracy=0.023, seconds=33.0, steps=150)))
  evaluation = dict(eval_metric="pass@1 (16 samples, T=1)", eval_problems=500)
  for seed, (rl, rft, sft) in enumerate([(0.10, 0.11, 0.08), (0.12, 0.09, 0.10)]):
    (work / f"rl_seed{seed}").mkdir()
    (work / f"rl_seed{seed}" / "summary.json").write_text(json.dumps(dict(
        steps=5, rl_seconds_this_run=100.0, final_eval_accuracy=rl, final_eval_greedy_accuracy=rl,
        final_eval_accuracy_se=0.01 + 0.002 * seed, final_eval_metric="pass@1 (16 samples, T=1)",
        final_eval_problems=500)))
    for arm, final in (("rft", rft), ("sft_short", sft)):
      (work / f"{arm}_seed{seed}").mkdir()
      (work / f"{arm}_seed{seed}" / "sft_summary.json").write_text(json.dumps(dict(
          seconds=100.0, steps=40, final_eval_accuracy=final, final_eval_greedy_accuracy=final,
          final_eval_accuracy_se=0.02, rft=dict(kept=10, sampled=100, rounds=3), **evaluation)))
  done = run()
  assert done.returncode == 0, done.stderr[-2000:]
  md = (out / "rl_vs_rft.md").read_text()
  assert "| rl | 2 | 11.0 +- 1.4 | 1.10 |" in md, md
  assert "| rft | 2 | 10.0 +- 1.4 | 2.00 |" in md and "pass@1 (16 samples, T=1), 500 problems" in md
  assert "matches or beats" in md  # (11.0 against 10.0)
  # an arm evaluated on 256 problems cannot stand beside them
  summary = json.loads((work / "rft_seed1" / "sft_summary.json").read_text())
  (work / "rft_seed1" / "sft_summary.json").write_text(json.dumps(dict(summary, eval_problems=256)))
  done = run()
  assert done.returncode != 0 and "evaluated differently" in done.stderr, done.stderr[-2000:]


def _moe_record(arm, seed, final, mismatch, **fields):
  """A fake record of benchmarks/moe_study.py (the full study's configuration)."""
  loss, replay = {"decoupled_ppo": ("decoupled_ppo", False), "decoupled_ppo_replay": ("decoupled_ppo", True),
                  "gspo_replay": ("gspo", True)}[arm]
  return dict(dict(arm=arm, seed=seed, loss=loss, replay_routes=replay, eta=4, steps=200, code_commit="abc1234",
                   study=dict(steps=200, overrides=[]), initial_final=0.30 + 0.01 * seed,
                   initial_final_greedy=0.60 + 0.01 * seed, final=final, final_greedy=0.5, final_se=0.015,
                   final_metric="pass@1 (4 samples, T=1)", final_problems=500, kl_behav_prox=1e-3 * (1 + mismatch),
                   moe_route_mismatch=mismatch, moe_aux_loss=1.05, moe_load_max=1.5, wall_seconds=1000.0 + seed,
                   rl_seconds=900.0, max_staleness_seen=4,
                   curves={"moe_route_mismatch": [mismatch] * 3, "kl_behav_prox": [1e-3] * 3}), **fields)


def test_moe_study_summary_by_hand_pairs_by_seed_and_refuses_mixed_records(tmp_path):
  """Per arm, each figure's mean, SE and t interval over seeds; paired differences seed by seed
  (scipy's one-sample interval gives the same); an arm's missing seed is named. The summary refuses
  records of two training-code commits, of two warm starts within a seed, and of another study."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  from benchmarks import moe_study  # pylint: disable=import-outside-toplevel
  d = tmp_path / "moe_study_arms"
  d.mkdir()
  put = lambda r: (d / f"{r['arm']}_seed{r['seed']}.json").write_text(json.dumps(r))
  for seed, (plain, replay, gspo) in enumerate([(0.40, 0.41, 0.45), (0.42, 0.45, 0.44), (0.44, 0.46, None)]):
    put(_moe_record("decoupled_ppo", seed, plain, 0.02))
    put(_moe_record("decoupled_ppo_replay", seed, replay, 0.01 * seed))
    if gspo is not None:
      put(_moe_record("gspo_replay", seed, gspo, 0.0))
  assert moe_study.main(["--assemble-only", "--out", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "moe_study.json").read_text())
  plain = result["arms"]["decoupled_ppo"]["final"]
  assert plain["per_seed"] == pytest.approx([40.0, 42.0, 44.0]) and plain["mean"] == pytest.approx(42.0)
  assert plain["se"] == pytest.approx(2.0 / np.sqrt(3))
  assert plain["high"] == pytest.approx(42.0 + stats.t.ppf(0.975, 2) * 2.0 / np.sqrt(3))
  assert result["arms"]["decoupled_ppo"]["gain"]["per_seed"] == pytest.approx([10.0, 11.0, 12.0])
  assert result["arms"]["decoupled_ppo"]["moe_route_mismatch"]["mean"] == pytest.approx(2.0)  # (in %)
  replay = result["pairs"]["replay_minus_no_replay"]
  assert replay["seeds"] == [0, 1, 2] and replay["final"]["per_seed"] == pytest.approx([1.0, 3.0, 2.0])
  ci = stats.ttest_1samp([1.0, 3.0, 2.0], 0.0).confidence_interval(0.95)
  assert (replay["final"]["low"], replay["final"]["high"]) == pytest.approx((ci.low, ci.high))
  assert replay["moe_route_mismatch"]["per_seed"] == pytest.approx([-2.0, -1.0, 0.0])
  assert replay["kl_behav_prox"]["per_seed"] == pytest.approx([-2e-5, -1e-5, 0.0])
  gspo = result["pairs"]["gspo_minus_decoupled_ppo"]
  assert gspo["seeds"] == [0, 1] and gspo["final"]["per_seed"] == pytest.approx([4.0, -1.0])
  assert result["missing"] == ["gspo_replay seed 2"] and result["code_commit"] == "abc1234"
  md = (tmp_path / "moe_study.md").read_text()
  # (the warm starts 30, 31 and 32: sd 1, half-width t(0.975, 2) / sqrt(3) = 2.48)
  assert "**Not run yet:** gspo_replay seed 2" in md and "| decoupled_ppo | 3 | 31.0 +- 0.6 [28.5, 33.5] |" in md
  assert "| replay_minus_no_replay | decoupled_ppo_replay - decoupled_ppo | 3 | 2.0 +- 0.6 [" in md
  assert (tmp_path / "moe_study.png").stat().st_size > 1000
  # another warm start within seed 1; then records of two training-code commits; then another study
  put(_moe_record("gspo_replay", 1, 0.44, 0.0, initial_final_greedy=0.7))
  with pytest.raises(SystemExit, match="seed 1's arms started from different warm starts"):
    moe_study.main(["--assemble-only", "--out", str(tmp_path)])
  put(_moe_record("gspo_replay", 1, 0.44, 0.0, code_commit="def5678"))
  with pytest.raises(SystemExit, match="different training code.*def5678: gspo_replay seed 1"):
    moe_study.main(["--assemble-only", "--out", str(tmp_path)])
  with pytest.raises(SystemExit, match="use another --name"):
    moe_study.main(["--assemble-only", "--out", str(tmp_path), "--steps", "100"])


def test_moe_study_reruns_an_unfinished_run_or_one_of_other_training_code(tmp_path, monkeypatch):
  """An arm's finished run in the work directory is reused only if it ran the same training code;
  an unfinished one, or one of other code, runs again from the start; a run whose config names
  another objective is refused (fake runs)."""
  from benchmarks import moe_study  # pylint: disable=import-outside-toplevel
  ran = []

  def fake_run(cmd, log, env=None):
    del log, env
    wd = next(a.split("=", 1)[1] for a in cmd if a.startswith("--workdir="))
    ran.append(os.path.basename(wd))
    os.makedirs(wd)
    loss = next(a.split("=", 1)[1] for a in cmd if a.startswith("--config.rl.loss="))
    with open(os.path.join(wd, "config.json"), "w") as f:
      json.dump(dict(seed=0, rl=dict(loss=loss, replay_routes="--config.rl.replay_routes=True" in cmd,
                                     staleness_mode="pinned", max_staleness=4)), f)
    with open(os.path.join(wd, "summary.json"), "w") as f:
      json.dump(dict(steps=3), f)

  monkeypatch.setattr(moe_study, "run_logged", fake_run)
  argv = moe_study._arm_argv("gspo_replay", 0, "ws", str(tmp_path), 3, [])  # pylint: disable=protected-access
  run = lambda code: moe_study._run_arm(str(tmp_path), "gspo_replay", 0, argv, 3, code)  # pylint: disable=protected-access
  assert run("abc")[1] == dict(steps=3) and ran == ["gspo_replay_seed0"]
  run("abc")
  assert ran == ["gspo_replay_seed0"]  # (finished with this code: reused)
  run("def")
  assert ran == ["gspo_replay_seed0"] * 2 and (tmp_path / "gspo_replay_seed0.code").read_text() == "def"
  os.remove(tmp_path / "gspo_replay_seed0" / "summary.json")  # (interrupted)
  run("def")
  assert len(ran) == 3
  with pytest.raises(SystemExit, match="not decoupled_ppo seed 0's"):
    moe_study._run_arm(str(tmp_path), "decoupled_ppo", 0, argv, 3, "def")  # pylint: disable=protected-access


def test_code_reward_benchmark_scores_right_and_wrong_programs_and_caches_a_groups_repeats():
  from benchmarks import code_reward  # pylint: disable=import-outside-toplevel
  rate = code_reward.distinct_rate(4, 2, seed=0)  # (asserts the worked solutions pass and the rest fail)
  assert rate["programs"] == 4 and rate["programs_per_s"] > 0
  repeated = code_reward.batch_seconds(1, 2, seed=1)
  assert repeated["completions"] == 128 and repeated["sandbox_runs"] == 16  # one run per group


def test_main_job_records_ranges_over_seeds_and_refuses_mixed_training_code(tmp_path, monkeypatch):
  """Each seed's record holds its summary's figures; the table's range is min-max over seeds by hand;
  a summary without its last evaluation, and records of two training-code commits, are refused."""
  from benchmarks import main_job  # pylint: disable=import-outside-toplevel
  def summary(before, after, greedy_before, greedy_after):
    return dict(initial_final_eval_accuracy=before, final_eval_accuracy=after,
                initial_final_eval_greedy_accuracy=greedy_before, final_eval_greedy_accuracy=greedy_after,
                final_eval_accuracy_se=0.01, final_eval_greedy_accuracy_se=0.02, final_eval_problems=500,
                steps=200, max_staleness_seen=2, max_staleness=2, warm_start_seconds=90.0, wall_seconds=600.0)
  runs = [main_job.record_of(summary(*v), seed, "abc", {"cpu_count": 2}) for seed, v in
          enumerate([(0.30, 0.39, 0.59, 0.60), (0.28, 0.40, 0.60, 0.61), (0.31, 0.38, 0.58, 0.605)])]
  assert runs[1]["final"] == 0.40 and runs[2]["final_greedy"] == 0.605 and runs[0]["versions"] == 200
  main_job.assemble(runs, out_dir=str(tmp_path))
  result = json.loads((tmp_path / "main_job.json").read_text())
  assert result["ranges"] == {"initial": [0.28, 0.31], "final": [0.38, 0.40], "initial_greedy": [0.58, 0.60],
                              "final_greedy": [0.60, 0.61]}
  assert result["minutes"] == [10.0, 10.0] and result["seeds"] == [0, 1, 2]
  md = (tmp_path / "main_job.md").read_text()
  assert "| range | 0.28-0.31 | 0.38-0.40 | 0.58-0.60 | 0.60-0.61 |" in md
  with pytest.raises(ValueError, match="final_eval_accuracy"):
    main_job.record_of(dict(summary(0.3, 0.4, 0.6, 0.6), final_eval_accuracy=None), 0, "abc", {})
  with pytest.raises(SystemExit, match="different training code"):
    main_job.assemble([runs[0], dict(runs[1], code_commit="def")], out_dir=str(tmp_path))


def test_every_benchmark_is_of_one_kind_and_the_index_names_each_script():
  """run_all's two kinds split BENCHMARKS exactly, and benchmarks/README.md lists every script that
  writes a record (the index a reader picks from)."""
  import pathlib  # pylint: disable=import-outside-toplevel
  from benchmarks import run_all  # pylint: disable=import-outside-toplevel
  speed, study = set(run_all.KINDS["speed"]), set(run_all.KINDS["study"])
  assert not speed & study and speed | study == set(run_all.BENCHMARKS)
  assert set(run_all.STUDIES) <= set(run_all.BENCHMARKS)  # (a renamed study would fall into speed)
  here = pathlib.Path(run_all.__file__).parent
  index = (here / "README.md").read_text()
  scripts = {p.name for p in here.glob("*.py")} - {"__init__.py", "common.py", "run_all.py", "shapes.py"}
  missing = sorted(s for s in scripts if f"`{s}`" not in index)
  assert not missing, f"benchmarks/README.md does not list {missing}"

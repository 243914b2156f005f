"""The main entry point runs end to end on the built-in config (tiny sizes) and writes its summary."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_entry_point_runs(tmp_path):
  cmd = [sys.executable, "-m", "asyncrl_jax.train", f"--config={ROOT}/configs/default.py",
         f"--workdir={tmp_path}", "--num_problems=5", "--config.data.max_completion_len=12"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
  assert out.returncode == 0, out.stderr[-2000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["devices"] == 4
  assert summary["learner_mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}
  assert summary["rollout_mesh"] == {"data": 3, "fsdp": 1, "tensor": 1}
  assert summary["problems"] == 5 and 0.0 <= summary["greedy_accuracy"] <= 1.0


def test_train_rejects_bad_config(tmp_path):
  cmd = [sys.executable, "-m", "asyncrl_jax.train", f"--config={ROOT}/configs/default.py",
         f"--workdir={tmp_path}", "--config.rl.eps_clip=0"]
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert out.returncode == 2
  assert "rl.eps_clip=0" in out.stderr

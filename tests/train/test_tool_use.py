"""The main job on multi-turn episodes (configs/tool_use.py, tiny): summary figures of tool use,
every turn in trajectories.jsonl, and a resume from a checkpoint taken with episodes in flight."""

import json
import os
import subprocess
import sys

import pytest

from asyncrl_jax.tokenization import ToolTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--config.learner.warm_start_steps=20", "--config.data.num_train=300", "--config.data.num_test=20",
        "--config.data.eval_problems=8", "--config.learner.batch_size=16", "--config.rl.group_size=4",
        "--config.rollout.num_slots=12", "--config.learner.eval_every=2", "--config.checkpoint.every_steps=2",
        "--config.learner.token_budget=2048", "--config.learner.warm_up=False",
        "--config.rollout.warm_up=False", "--config.log.trajectories=2", "--config.data.eval_samples=2",
        "--config.learner.warm_start_lr=3e-3"]


def _run(workdir, *overrides):
  cmd = [sys.executable, "-m", "asyncrl_jax.train", f"--config={ROOT}/configs/tool_use.py",
         f"--workdir={workdir}", *TINY, *overrides]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out


def _lines(path):
  return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


@pytest.mark.slow(90)
def test_tool_use_runs_and_resumes_with_episodes_in_flight(tmp_path):
  _run(tmp_path, "--config.steps=2")
  summary = json.loads((tmp_path / "summary.json").read_text())
  for key in ("tool_calls_per_episode", "turns_per_episode", "tool_errors", "env_failures"):
    assert key in summary, sorted(summary)
  assert summary["episodes"] == 2 * 16
  # the warm start teaches calls: episodes called the calculator and took more than one turn
  assert summary["tool_calls_per_episode"] > 0 and summary["turns_per_episode"] > 1.0, summary
  assert summary["final_eval_accuracy"] is not None
  tok = ToolTokenizer()
  dumped = _lines(tmp_path / "trajectories.jsonl")
  assert [d["version"] for d in dumped] == [0, 0, 1, 1]
  for d in dumped:
    mask, tokens = d["action_mask"], d["completion_tokens"]
    at = 0
    for turn in d["turns"]:
      (a0, a1), (o0, o1) = turn["action"], turn["observation"]
      assert at == a0 <= a1 == o0 <= o1 and all(mask[a0:a1]) and not any(mask[o0:o1])
      assert turn["action_text"] == tok.decode(tokens[a0:a1])
      assert turn["observation_text"] == tok.decode(tokens[o0:o1])
      assert {"reward", "latency", "error", "ended", "info"} <= set(turn)
      at = o1
    assert at == len(tokens) and d["finish_reason"] in ("eos", "length", "turns", "env_done")
    assert all(v == -1 for v, m in zip(d["versions"], mask) if not m)
    assert all(lp == 0.0 for lp, m in zip(d["behaviour_logprobs"], mask) if not m)
  # the first run stopped with the episodes of the next versions in flight (eta 2); the resumed one
  # regenerates them: every version trained once, no prompt trained twice
  _run(tmp_path, "--config.steps=4")
  versions = [r["version"] for r in _lines(tmp_path / "metrics.jsonl")]
  assert versions == [1, 2, 3, 4]
  prompts = [p for r in _lines(tmp_path / "trained_prompts.jsonl") for p in r["prompts"]]
  assert len(prompts) == len(set(prompts)) == 4 * 4
  assert [d["version"] for d in _lines(tmp_path / "trajectories.jsonl")] == [0, 0, 1, 1, 2, 2, 3, 3]

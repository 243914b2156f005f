"""The run log: everything the main job writes about a run, except its checkpoints.

``RunLog`` owns ``DIR/config.json``, ``DIR/metrics.jsonl`` (one record per policy version),
``DIR/trained_prompts.jsonl``, ``DIR/trajectories.jsonl`` (``log.trajectories`` per version), TensorBoard
events in ``DIR/tb``, the progress bar, the in-memory
history, the run's running totals, and at the end ``DIR/summary.json``, ``DIR/progress.png`` and the
printed summary table. On resume it keeps the records up to the checkpoint resumed from (``resume``);
on a fresh start it removes an earlier run's (``start_fresh``).

``DIR`` may be a bucket (``gs://bucket/run``): every file goes through ``asyncrl_jax.infra.paths``, where
appending a record to an object rewrites it whole (``paths.append_text``), and TensorBoard's event file
is kept in memory and uploaded whole on each of the writer's flushes (every two minutes, and at close).
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from typing import Callable, Optional

import numpy as np

from asyncrl_jax.infra import paths
from asyncrl_jax.infra.progress import progress
from asyncrl_jax.learner import learner as learner_lib
from asyncrl_jax.rollout import protocol
from asyncrl_jax.rollout.stats import DecodeStats


class _Compiles:
  """Counts XLA compilations in this process (JAX's monitoring events): a jit cache that keeps
  growing after warm-up shows up as a count that keeps growing."""

  def __init__(self):
    self.count = 0
    import jax  # pylint: disable=import-outside-toplevel
    jax.monitoring.register_event_duration_secs_listener(self._on)

  def _on(self, event: str, duration: float, **kwargs) -> None:
    del duration, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      self.count += 1


_COMPILES: Optional[_Compiles] = None


def process_memory() -> dict:
  """This process's memory, for a version's record: host RSS (MB), the bytes and number of live JAX
  arrays, and the XLA compilations so far (counted from the first call on)."""
  global _COMPILES  # pylint: disable=global-statement
  import jax  # pylint: disable=import-outside-toplevel
  if _COMPILES is None:
    _COMPILES = _Compiles()
  with open("/proc/self/statm") as f:
    rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  live = jax.live_arrays()
  return dict(host_rss_mb=rss / 2 ** 20, live_array_mb=sum(x.nbytes for x in live) / 2 ** 20,
              live_arrays=len(live), xla_compiles=_COMPILES.count)


def say(msg: str) -> None:
  print(f"[asyncrl_jax] {msg}", flush=True)


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = v
  return out


def record_config(config, path: str) -> None:
  """Writes the run's full config to ``path``; a rerun in the same directory with other values says
  which (a resume continues from the checkpoint either way)."""
  new = json.loads(config.to_json_best_effort())
  if paths.exists(path):
    old = _flat(json.loads(paths.read_text(path)))
    flat = _flat(new)
    changed = sorted(k for k, v in flat.items() if old.get(k, v) != v)
    if changed:
      say("config differs from this directory's previous run: " + ", ".join(
          f"{k}={old[k]!r} -> {flat[k]!r}" for k in changed))
  paths.write_text(path, json.dumps(new, indent=2))


def truncate_jsonl(path: str, keep: Callable[[dict], bool]) -> None:
  """Keeps the records of ``path`` that ``keep`` accepts (those up to the checkpoint resumed from).

  A last line without its newline is a record cut short by a kill. Records are written before the
  checkpoint of their version, so it is always one the resume drops anyway; any other unreadable line
  is an error.
  """
  if not paths.exists(path):
    return
  lines = io.StringIO(paths.read_text(path)).readlines()
  kept = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    if i == len(lines) - 1 and not line.endswith("\n"):
      say(f"dropping a record cut short at the end of {path}")
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}, line {i + 1}: not a JSON record ({e}); the log is damaged") from e
    if keep(record):
      kept.append(line)
  paths.write_text(path, "".join(kept))


def _append_jsonl(path: str, record: dict) -> None:
  paths.append_text(path, json.dumps(record) + "\n")


def _load_jsonl(path: str) -> list[dict]:
  if not paths.exists(path):
    return []
  return [json.loads(l) for l in paths.read_text(path).split("\n") if l.strip()]


class _RemoteEventFiles:
  """tensorboardX's writer factory for a scheme (``record_writer.register_writer_factory``): event
  files as ``paths.RewrittenFile``, so TensorBoard writes to a bucket with this project's backend
  (tensorboardX's own ``gs://`` writer needs ``google-cloud-storage``)."""

  def open(self, path: str) -> paths.RewrittenFile:
    return paths.RewrittenFile(path)

  def directory_check(self, path: str) -> None:
    del path  # objects need no directories


def _summary_writer(logdir: str):
  from tensorboardX import SummaryWriter, record_writer  # pylint: disable=import-outside-toplevel
  if paths.is_remote(logdir):
    record_writer.register_writer_factory(logdir.split("://", 1)[0], _RemoteEventFiles())
  return SummaryWriter(logdir)


class RunLog:
  """The run's records and running totals (see the module docstring)."""

  def __init__(self, workdir: str, config, tokenizer=None):
    """``tokenizer``: decodes the text of the trajectories written with ``log.trajectories``."""
    self.workdir = workdir
    paths.makedirs(workdir)
    self.t_start = time.time()
    self.metrics_path = paths.join(workdir, "metrics.jsonl")
    self.prompts_path = paths.join(workdir, "trained_prompts.jsonl")
    self.trajectories_path = paths.join(workdir, "trajectories.jsonl")
    self.trajectories_per_version = int(config.log.trajectories)
    self.tokenizer = tokenizer
    if self.trajectories_per_version and tokenizer is None:
      raise ValueError("log.trajectories > 0 needs the run's tokenizer (to write each turn's text)")
    record_config(config, paths.join(workdir, "config.json"))
    self.steps, self.eta, self.loss = config.steps, config.rl.max_staleness, config.rl.loss
    self.history: list[dict] = []
    self._writer = self._bar = None
    self._decode_base: Optional[DecodeStats] = None
    self.decode, self.decode_seconds = DecodeStats(), 0.0  # as of the last version
    self.t_rl = self.rl_tokens = self.train_seconds = 0.0  # this process's RL phase
    self._last_eval: Optional[float] = None  # for the progress bar

  # ------------------------------------------------------------------ start

  def resume(self, version: int) -> None:
    """Keeps the records of versions up to ``version`` (the checkpoint resumed from)."""
    truncate_jsonl(self.metrics_path, lambda r: r.get("version", 0) <= version)
    truncate_jsonl(self.prompts_path, lambda r: r["version"] < version)
    truncate_jsonl(self.trajectories_path, lambda r: r["version"] < version)
    self.history = _load_jsonl(self.metrics_path)

  def start_fresh(self) -> None:
    for path in (self.metrics_path, self.prompts_path, self.trajectories_path):
      if paths.exists(path):
        paths.remove(path)
    self.history = []

  def start_rl(self, version: int, decode_stats: DecodeStats) -> None:
    """RL starts now at ``version``; decode counters count from ``decode_stats`` (remote decode servers
    may have been up, idle, for a while)."""
    self._writer = _summary_writer(paths.join(self.workdir, "tb"))
    self._bar = progress(total=self.steps, initial=version, desc=f"async RL (eta={self.eta}, {self.loss})",
                         unit="step")
    self._decode_base, self.t_rl = decode_stats, time.time()
    process_memory()  # (compilations count from here)

  # ------------------------------------------------------------------ per version

  def version_record(self, batch, update: dict, transfer, decode_stats: DecodeStats, *,
                     transfer_seconds: float) -> dict:
    """The metrics record of the version ``update`` (``Learner.train``'s metrics) just trained;
    ``transfer`` is its publish (``seconds``: how long the learner was blocked), ``transfer_seconds``
    the slowest decode server's pull of the newest version every server holds."""
    tokens = int(sum(s.mask.sum() for s in batch.sequences))
    self.rl_tokens += tokens
    self.train_seconds += update["learner_seconds"]
    self.decode = decode_stats.since(self._decode_base)
    self.decode_seconds = time.time() - self.t_rl
    return dict(
        version=update["version"], time=time.time() - self.t_start, reward=float(batch.rewards.mean()),
        accuracy=float((batch.rewards == 1.0).mean()), trained_tokens=tokens,
        truncated_frac=float(np.mean([t.finish_reason == "length" for t in batch.trajectories]))
        if batch.trajectories else 0.0,
        max_staleness_seen=batch.max_staleness_seen, mean_staleness=batch.mean_staleness,
        min_staleness_seen=batch.min_staleness_seen, filtered_groups=batch.filtered_groups,
        overlong_filtered=batch.overlong_filtered, overlong_penalty=batch.overlong_penalty,
        failed_rollouts=batch.failed, publish_blocked_seconds=transfer.seconds,
        batch_wait_seconds=batch.wait_seconds, reward_wait_seconds=batch.reward_wait_seconds,
        transfer_seconds=transfer_seconds,
        tokens_per_s=self.rl_tokens / max(self.decode_seconds, 1e-9),
        learner_idle_fraction=learner_lib.idle_fraction(self.train_seconds, self.decode_seconds),
        **episode_metrics(batch.trajectories),
        # cumulative decode counters since RL started, summed over the decode servers
        **self.decode.as_metrics(),
        **process_memory(),  # (learner process 0, and the decode server when it runs here)
        **{k: v for k, v in update.items() if k != "version"})

  def trajectory_record(self, version: int, t, reward: float) -> dict:
    """One line of ``trajectories.jsonl``: a trajectory trained at ``version`` as the learner saw it.
    ``action_mask`` marks the policy's sampled tokens (1) against context (0) over the completion."""
    completion = [int(x) for x in t.completion_tokens]
    return {"version": version, "trajectory_id": t.trajectory_id, "prompt_id": t.prompt_id,
            "server_id": t.server_id, "prompt_tokens": [int(x) for x in t.prompt_tokens],
            "completion_tokens": completion, "prompt_text": self.tokenizer.decode(t.prompt_tokens),
            "completion_text": self.tokenizer.decode(completion),
            "action_mask": [int(a) for a in t.actions],
            "versions": [int(v) for v in t.versions], "behaviour_logprobs": [float(x) for x in t.logprobs],
            "reward": reward, "finish_reason": t.finish_reason, "interruptions": int(t.num_interruptions),
            **({"turns": self._turns(t)} if t.turns is not None else {})}

  def _turns(self, t) -> list:
    """An episode's turns with the text of each action and observation."""
    out = []
    for turn in t.turns:
      (a0, a1), (o0, o1) = turn.action, turn.observation
      out.append(dict(protocol.turn_to_json(turn), action_text=self.tokenizer.decode(t.completion_tokens[a0:a1]),
                      observation_text=self.tokenizer.decode(t.completion_tokens[o0:o1])))
    return out

  def append(self, record: dict, batch, alarms: tuple = ()) -> None:
    """Writes a version's record (metrics.jsonl, TensorBoard, progress bar) and its trained prompts;
    ``alarms``: the health monitor's signals active at this version (shown on the progress bar, and
    as ``alarm_<signal>`` = 1 in TensorBoard)."""
    if alarms:
      record = dict(record, alarms=list(alarms))
    _append_jsonl(self.metrics_path, record)
    self.history.append(record)
    _append_jsonl(self.prompts_path, {"version": batch.version, "prompts": batch.prompt_indices,
                                      "digests": batch.prompt_digests,
                                      "trajectory_ids": [t.trajectory_id for t in batch.trajectories],
                                      "completion_lengths": [len(t.completion_tokens)
                                                             for t in batch.trajectories],
                                      # when each finished (a group's last one releases it)
                                      "finished_at": [round(t.finished_at, 3)
                                                      for t in batch.trajectories]})
    n = self.trajectories_per_version
    for t, reward in (zip(batch.trajectories[:n], batch.rewards[:n]) if n else ()):
      _append_jsonl(self.trajectories_path, self.trajectory_record(batch.version, t, float(reward)))
    for k, v in record.items():
      if isinstance(v, (int, float)):
        self._writer.add_scalar(k, v, record["version"])
    for signal in alarms:
      self._writer.add_scalar(f"alarm_{signal}", 1.0, record["version"])
    self._last_eval = record.get("eval_accuracy", self._last_eval)
    self._bar.update(1)
    self._bar.set_postfix(reward=f"{record['reward']:.2f}", v=record["version"],
                          stale=batch.max_staleness_seen, tok_s=f"{record['tokens_per_s']:.0f}",
                          **({"eval": f"{self._last_eval:.2f}"} if self._last_eval is not None else {}),
                          **({"ALARM": ",".join(alarms)} if alarms else {}))

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    if self._writer is not None:
      self._writer.close()

  # ------------------------------------------------------------------ end

  def summary(self, meta: dict, **fields) -> dict:
    """The run's summary from its history, the checkpoint meta and ``fields`` (evaluation, devices...)."""
    seconds = time.time() - self.t_rl
    return {
        "initial_eval_accuracy": meta["initial_eval_accuracy"],
        "untrained_eval_accuracy": meta.get("untrained_eval_accuracy"),
        "initial_eval_greedy_accuracy": meta["initial_eval_greedy_accuracy"],
        **{k: v for k, v in meta.items() if k.startswith("initial_final_eval_")},
        "trained_tokens": sum(h.get("trained_tokens", 0) for h in self.history),
        "wall_seconds": time.time() - self.t_start,
        "rl_seconds_this_run": seconds,
        "effective_tokens_per_s": self.rl_tokens / max(seconds, 1e-9),
        "max_staleness_seen": max((h.get("max_staleness_seen", 0) for h in self.history), default=0),
        "max_staleness": self.eta,
        "loss": self.loss,
        "warm_start_seconds": meta.get("warm_start_seconds"),
        "learner_idle_fraction": learner_lib.idle_fraction(self.train_seconds, seconds),
        "decode_slot_utilization": self.decode.slot_utilization(self.decode_seconds),
        **self._episode_summary(),
        **fields,
    }

  def _episode_summary(self) -> dict:
    """Over the trained episodes: tool calls per episode, tool errors, turns per episode (nothing
    for single-turn runs)."""
    episodes = sum(h.get("episodes", 0) for h in self.history)
    if not episodes:
      return {}
    total = lambda k: sum(h.get(k, 0) * h.get("episodes", 0) for h in self.history)  # noqa: E731
    return {"episodes": episodes,
            "tool_calls_per_episode": total("tool_calls_per_episode") / episodes,
            "turns_per_episode": total("turns_per_episode") / episodes,
            "tool_errors": sum(h.get("tool_errors", 0) for h in self.history),
            "env_failures": sum(h.get("env_failures", 0) for h in self.history)}

  def finish(self, summary: dict) -> None:
    """Writes summary.json and progress.png and prints the summary table."""
    paths.write_text(paths.join(self.workdir, "summary.json"), json.dumps(summary, indent=2))
    _plot(self.history, summary, paths.join(self.workdir, "progress.png"))
    _print_summary(summary)


def episode_metrics(trajectories) -> dict:
  """A batch's episodes (trajectories with turns): how many, tool calls and turns per episode, tool
  errors (failed calls the episode survived), and episodes an environment failure or timeout ended."""
  episodes = [t for t in trajectories if t.turns is not None]
  if not episodes:
    return {}
  turns = [turn for t in episodes for turn in t.turns]
  return {"episodes": len(episodes),
          "tool_calls_per_episode": sum("tool" in turn.info for turn in turns) / len(episodes),
          "turns_per_episode": len(turns) / len(episodes),
          "tool_errors": sum(bool(turn.error) for turn in turns),
          "env_failures": sum(t.finish_reason in ("env_error", "env_timeout") for t in episodes)}


def _with_se(summary: dict, key: str):
  """``summary[key]`` with its standard error (``key + "_se"``) when the summary has one."""
  value, se = summary.get(key), summary.get(key + "_se")
  return value if value is None or se is None else f"{value:.3f} +- {se:.3f}"


def _print_summary(summary: dict) -> None:
  # before RL as the last version was evaluated, when the run measured it (data.initial_eval_final)
  like = "initial_final_eval_accuracy" in summary
  before = "initial_final_eval" if like else "initial_eval"
  rows = [("held-out accuracy, before RL", _with_se(summary, f"{before}_accuracy")),
          ("held-out accuracy, after RL", _with_se(summary, "final_eval_accuracy")),
          ("  (metric)", summary.get("final_eval_metric") or summary["eval_metric"]),
          ("held-out greedy accuracy, before RL", _with_se(summary, f"{before}_greedy_accuracy")),
          ("held-out greedy accuracy, after RL", _with_se(summary, "final_eval_greedy_accuracy")),
          ("policy versions trained", summary["steps"]),
          ("trained tokens", summary["trained_tokens"]),
          ("effective tokens/s", summary["effective_tokens_per_s"]),
          ("max staleness seen / allowed", f"{summary['max_staleness_seen']} / {summary['max_staleness']}"),
          ("learner idle fraction", summary["learner_idle_fraction"]),
          ("decode slot utilization", summary["decode_slot_utilization"]),
          ("wall seconds", summary["wall_seconds"])]
  if summary.get("episodes"):
    rows += [("tool calls / turns per episode",
              f"{summary['tool_calls_per_episode']:.2f} / {summary['turns_per_episode']:.2f}"),
             ("tool errors / environment failures",
              f"{summary['tool_errors']} / {summary['env_failures']}")]
  if summary.get("transfer_bytes_sent"):
    rows += [("learner processes / decode servers",
              f"{summary['learner_processes']} / {summary['decode_servers']}"),
             ("weight MB sent, per learner process",
              " ".join(f"{b / 1e6:.1f}" for b in summary["transfer_bytes_sent"]))]
  width = max(len(r[0]) for r in rows)
  print("\n" + "-" * (width + 16))
  for name, value in rows:
    value = f"{value:.3f}" if isinstance(value, float) else "n/a" if value is None else str(value)
    print(f"{name:<{width}}  {value:>12}")
  print("-" * (width + 16), flush=True)


def _plot(history, summary, path) -> None:
  if not history:
    return
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(7, 4))
  t = [h["time"] for h in history]
  ax.plot(t, [h["reward"] for h in history], alpha=0.5, label="batch reward (sampled)")
  ev = [h for h in history if "eval_accuracy" in h]
  t_ev = [history[0]["time"]] + [h["time"] for h in ev]
  if summary["eval_metric"] is not None:  # (learner.eval_every=0: no evaluation to plot)
    ax.plot(t_ev, [summary["initial_eval_accuracy"]] + [h["eval_accuracy"] for h in ev], "o-",
            label=f"held-out accuracy ({summary['eval_metric']})")
  if summary["eval_metric"] not in ("greedy", None):
    ax.plot(t_ev, [summary["initial_eval_greedy_accuracy"]] +
            [h.get("eval_greedy_accuracy", np.nan) for h in ev], "s--", label="held-out greedy accuracy")
  ax.set_xlabel("seconds")
  ax.set_ylim(0, 1)
  ax.set_title(f"{summary['loss']}, eta={summary['max_staleness']}")
  ax.legend()
  fig.tight_layout()
  png = io.BytesIO()
  fig.savefig(png, format="png", dpi=100)
  plt.close(fig)
  paths.write_bytes(path, png.getvalue())
